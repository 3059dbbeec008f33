"""What a pipeline rank holds during its steps beyond the model state (``estimate.estimate_memory``'s
``activations``, ``receive buffers``, ``temporaries`` and ``grad sync`` terms), from one micro-batch's
trace per stage (``estimate.trace``) and the order in which torch's schedule runs the rank's actions.

Besides what each micro-batch's forward keeps for its backward, torch's multi-stage schedules
(interleaved 1F1B, looped BFS, zero bubble, with one stage per rank too, ZBV, DualPipeV) keep every
tensor a rank sends to another rank alive until the step ends: their runtime waits on its sends only
then, and a pending send holds its tensor. So a stage's output, sent on, outlives its micro-batch's
backward, and the grads of its inputs, sent back, outlive the backward that made them (measured on
the job's default model at pp=2 x dp=2 with interleaved 1F1B: every sent tensor freed at the step's
end; the estimate without them was 0.985-0.987 of every rank's measured peak, with them 1.000-1.004).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from ndweave.ddp.cost import GradSync
from ndweave.pipeline.cost import StageActivations, held_saved_bytes, receive_buffer_bytes, torch_action_order
from ndweave.pipeline.plan import ResolvedPlan
from ndweave.plan.estimate import MemoryTerm

__all__ = ["activation_terms", "rank_actions", "sent_bytes"]

_ACTIONS: dict[tuple, tuple] = {}  # see rank_actions


def activation_terms(resolved: ResolvedPlan, traced: list[StageActivations], io: list, coordinate: dict[str, int],
                      tied_grads: int, syncs: dict[int, GradSync]) -> list[MemoryTerm]:
    """What the rank holds during its steps beyond the model state: the micro-batches in flight at the
    schedule's peak and what its sends still hold, the buffers torch's pipeline stage receives into,
    the temporaries of one micro-batch's forward and backward on top, and the grad syncs where they
    hold more than those. ``io``: each stage's ``estimate.StageBytes``.

    A micro-batch holds, from its forward to its backward, what its forward and the loss saved and
    the stage's output (torch's stage keeps it for the backward; a cut's output is saved by no op of
    its stage); with split backward also, from the input-grad step to the weight-grad step, the grads
    of its weight ops' outputs. A multi-stage schedule's sends hold what they send to the step's end
    (:func:`sent_bytes`). A stage receives into buffers of its own, one per micro-batch for the
    whole run (allocated at the first step): the activations from the stage before and the output's
    grads from the stage after; so the received activations, which the stage's first op saves, are
    counted there once, not per micro-batch in flight. The temporaries are the trace's peak less what
    it saved and the output, plus the grads summed for a weight tied across ranks (held over the step).
    A chunk's grad sync, at the end of its last backward, holds its reduce copies and published grads
    (:class:`GradSync`) besides what the rank's other chunks still hold."""
    pp_rank = coordinate["PP"]
    stages = resolved.stages_of(pp_rank)
    last = resolved.num_stages - 1
    held = [one.saved_bytes + x.loss_saved - x.received + x.output for one, x in zip(traced, io)]
    # the input-grad step detaches the loss (or the outputs), freeing the graph above the weight ops:
    # on the last stage the loss's saved tensors and the logits go there (an earlier stage's outputs
    # stay referenced until the weight step)
    split = [x.weight_op_outputs - (x.loss_saved + x.output if s == last else 0) for s, x in enumerate(io)]
    temps = {s: traced[s].peak_bytes - traced[s].saved_bytes - io[s].loss_saved - io[s].output + syncs[s].in_flight
             for s in stages}
    saved, temporary, at_sync = _held_bytes(resolved, pp_rank, held, split, temps, syncs, [x.output for x in io],
                                            [x.received for x in io])
    temporary += tied_grads
    if not issubclass(resolved.schedule, PipelineScheduleMulti) and last in stages:
        at_sync += io[last].output  # torch's single-stage loop keeps the last forward's logits until it returns
    buffers = receive_buffer_bytes(resolved, pp_rank, [x.received for x in io], [x.output for x in io])
    return [MemoryTerm("activations", saved, "pipeline", persistent=False),
            MemoryTerm("receive buffers", buffers, "pipeline"),
            MemoryTerm("temporaries", temporary, "pipeline", persistent=False),
            MemoryTerm("grad sync", max(0, at_sync - saved - temporary), "ddp", persistent=False)]


def sent_bytes(resolved: ResolvedPlan, outputs: Sequence[int], inputs: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per stage, what it sends to another PP rank and a multi-stage schedule keeps until the step ends:
    its output, sent on (``outputs[s]``; none from the last stage, whose output is the loss's), and the
    grads of its inputs, sent back (``inputs[s]``: what it receives; none to the first stage). A
    neighbour on the same rank (a V-shaped schedule's turn) is handed its tensors, not sent them."""
    rank_of = {stage: rank for rank in range(resolved.pp_size) for stage in resolved.stages_of(rank)}
    last = resolved.num_stages - 1
    on = [outputs[s] if s < last and rank_of[s + 1] != rank_of[s] else 0 for s in range(resolved.num_stages)]
    back = [inputs[s] if s > 0 and rank_of[s - 1] != rank_of[s] else 0 for s in range(resolved.num_stages)]
    return on, back


def _held_bytes(resolved: ResolvedPlan, pp_rank: int, held: list[int], split: list[int], temps: dict[int, int],
                syncs: dict[int, GradSync], outputs: list[int], inputs: list[int]) -> tuple[int, int, int]:
    """The rank's peak along the order torch runs its actions, as what its micro-batches in flight and
    pending sends hold then and the temporaries of the action's stage on top (``temps``: one
    micro-batch's, per stage of the rank), and the most its grad syncs hold with what is held. A micro-batch
    holds ``held`` per stage from its forward to its backward (``pipeline.cost.held_saved_bytes``),
    with split backward ``split`` from its input-grad step (``I``) to its weight-grad step (``W``);
    the output it sent on stays held after its backward, the input grads it sends back from the
    backward that makes them (``B`` or ``I``), both to the step's end (:func:`sent_bytes`); each
    chunk's sync comes with its last backward, its published grads held from then on."""
    if not issubclass(resolved.schedule, PipelineScheduleMulti):  # one stage: its sync ends the step
        (stage,) = resolved.stages_of(pp_rank)
        return (held_saved_bytes(resolved, pp_rank, held), temps[stage],
                syncs[stage].published + syncs[stage].reduce_copy)
    on, back = sent_bytes(resolved, outputs, inputs)
    actions = rank_actions(resolved, pp_rank)
    last_backward = {stage: i for i, (kind, stage, _) in enumerate(actions) if kind in ("B", "W")}
    now = published = at_sync = 0
    peak = (0, 0)  # (held, temporaries) at the peak
    for i, (kind, s, _) in enumerate(actions):
        if kind == "F":  # its temporaries come with what it keeps
            now += held[s]
        if now + temps[s] > sum(peak):  # a backward's temporaries come before it frees its micro-batch
            peak = (now, temps[s])
        now += {"F": 0, "I": split[s] + back[s], "W": on[s] - held[s] - split[s], "B": on[s] + back[s] - held[s]}[kind]
        if last_backward[s] == i:
            published += syncs[s].published
            at_sync = max(at_sync, now + published + syncs[s].reduce_copy)
    return (*peak, at_sync)


def rank_actions(resolved: ResolvedPlan, pp_rank: int) -> tuple[tuple[str, int, int], ...]:
    """``torch_action_order(resolved)[pp_rank]``, kept per schedule shape (a planner asks for the same
    order for every layout and rank that shares it)."""
    shape = (resolved.schedule, resolved.pp_size, resolved.num_stages, resolved.num_microbatches, resolved.v_shaped)
    if (*shape, pp_rank) not in _ACTIONS:
        _ACTIONS.update({(*shape, rank): tuple(actions) for rank, actions in torch_action_order(resolved).items()})
    return _ACTIONS[(*shape, pp_rank)]
