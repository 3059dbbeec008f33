"""The job's settings: frozen dataclasses, one per concern, a docstring per field. The command line
is generated from them: each field is the flag ``--field-name`` (unless its metadata names another),
its default the flag's, its docstring the flag's ``--help``.

    config = parse_args(["--mesh", "pp=2,dp=2", "--steps", "3"])   # what ``python -m ndweave_gpt`` parses
    config.parallel.mesh, config.training.steps                     # "pp=2,dp=2", 3
    config.replace(mesh="dp=4", micro_batches=2)                    # a copy, fields named as in their class

A field's metadata may hold ``flag`` (another flag name), ``choices``, ``metavar`` and ``const`` (the
flag's value may be left out: ``--resume`` alone means ``always``). ``ModelConfig.hf_config`` is no
flag: :func:`parse_args` reads it from ``--model`` / ``--config`` / ``--init-from``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import json
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

from ndweave_gpt.data import VALIDATION_WINDOWS
from ndweave_gpt.models import hf

__all__ = ["CheckpointConfig", "DataConfig", "DIMS", "DTYPES", "FaultConfig", "JobConfig", "MetricsConfig",
           "ModelConfig", "ParallelConfig", "PlanConfig", "TrainingConfig", "build_parser", "num_experts",
           "parse_args"]

#: ``--dtype``'s names
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "float64": torch.float64}
#: The mesh's dims, outermost first (EP inside DP: the EP ranks split the batch like DP ranks; CP ranks
#: split each sequence).
DIMS = ("PP", "DP", "CP", "EP", "TP")


@dataclass(frozen=True)
class ParallelConfig:
    """How the job is laid out over its ranks."""

    mesh: str = field(default="pp=2,dp=2,tp=2", metadata={"metavar": "SPEC"})
    """sizes of pp, dp, cp, ep, tp (omitted: 1; one of them -1: the rest of the world, e.g. dp=-1); cp (context
    parallel): CP ranks split each sequence, attention across them; ep (expert
    parallel, with --moe-experts): EP ranks split the batch like DP ranks and divide the experts; auto: the
    fastest layout (mesh, schedule, micro-batches, recompute) whose estimated memory fits --memory-per-device
    on --world-size ranks, printed, then run"""
    activation_checkpointing: bool = False
    """recompute each layer's activations in backward instead of keeping them"""
    zero_stage: int = field(default=1, metadata={"choices": (1, 2)})
    """what the data ranks split: 1, the optimizer's state and masters (ZeRO-1); 2, the grads too (ZeRO-2: each
    backward reduce-scatters its grads, so a step with m micro-batches makes m)"""
    micro_batches: int = 4
    """pipeline micro-batches per DP rank's batch"""
    schedule: str = "1f1b"
    """pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zero_bubble, ..."""
    virtual_chunks: int = 1
    """stages per PP rank (interleaved schedules: 2)"""
    no_sp: bool = False
    """tensor parallel without sequence parallel"""
    compile: bool = False
    """torch.compile each transformer block (inductor) before DDP wraps it; the step that compiles is reported
    apart, with its graph breaks (under ep, only at each MoE block's token dispatch). The estimate and --mesh
    auto price the eager job"""
    tp_plan: str = field(default="zoo", metadata={"flag": "--plan", "choices": ("zoo", "auto")})
    """the TP plan: the zoo's hand-written one for the model's family (nanogpt, hf_llama, hf_gpt2, the MoE
    families; others: auto), or derived from the model (get_plan('auto'))"""
    timeout: float = 30.0
    """seconds a collective waits for a peer: a dead rank surfaces as an error within it"""
    compile_timeout: float = 600.0
    """with --compile, the --timeout of the steps that compile (the run's first, and the first to evaluate),
    as peers wait for a rank compiling its blocks (half a minute for the tiny GPT at 8 ranks on 2 cores,
    minutes for a large model; torchtitan's init_timeout_seconds). The groups are made with it and lowered
    to --timeout after those steps; on gloo (CPU) a point-to-point receive keeps it, as gloo fixes a
    receive's timeout when it connects the group"""
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL, one GPU per rank)"""


@dataclass(frozen=True)
class PlanConfig:
    """What is planned or estimated before launch (``cost/``)."""

    world_size: int = 0
    """--mesh auto: ranks to plan for (default: torchrun's WORLD_SIZE, the visible GPUs, or 8 CPU ranks)"""
    memory_per_device: float = field(default=0.0, metadata={"metavar": "GiB"})
    """--mesh auto: memory each rank may hold (default: a GPU's memory, or the host's available memory shared
    by the ranks)"""
    estimate: bool = False
    """print each rank's estimated peak memory for --mesh (parameters, grads, optimizer state, activations in
    flight, ...) and exit: nothing launched, nothing allocated"""
    memory_check: bool = False
    """also measure each rank's peak of live tensor bytes over the training steps (torch's tracker: slow) and
    print it beside the estimate"""


@dataclass(frozen=True)
class ModelConfig:
    """The model trained."""

    name: str = field(default="nanogpt", metadata={"flag": "--model", "metavar": "nanogpt|hf:TYPE"})
    """models/nanogpt.py's GPT, or a transformers causal LM of that model type (hf:llama, hf:qwen2, hf:mixtral,
    ...; needs the transformers package)"""
    config: str = field(default="tiny", metadata={"metavar": "tiny|small|CONFIG.json"})
    """the hf: model's size: a preset (vocabulary 256, the data's bytes) or a config.json"""
    init_from: str = field(default="", metadata={"metavar": "DIR|FILE.pt"})
    """start from these weights: a transformers checkpoint folder (config.json + model.safetensors or its
    sharded index; the model and its config come from it), or a torch state dict of the model --model/--config
    build; each rank reads only the slices it holds"""
    n_layer: int = 4
    """nanogpt's layers"""
    n_embd: int = 128
    """nanogpt's width"""
    n_head: int = 4
    """nanogpt's heads"""
    block_size: int = 64
    """tokens (bytes) per sample"""
    vocab_size: int = 0
    """the vocabulary of a model built here (nanogpt, an hf: preset; 0: 256, the bytes; with --data and a
    tokenizer, the tokenizer's size); a config.json or --init-from folder says its own"""
    moe_experts: int = 0
    """experts per MoE block in place of each MLP (0: dense)"""
    moe_top_k: int = 2
    """experts each token is routed to (with --moe-experts)"""
    dtype: str = field(default="fp32", metadata={"choices": tuple(DTYPES)})
    """bf16: bf16 params, fp32 masters"""
    hf_config: Any = field(default=None, compare=False, repr=False, metadata={"flag": None})
    """(no flag) the hf: model's transformers config, read by :func:`parse_args`; None for nanogpt"""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class TrainingConfig:
    """The optimization: steps, learning rate schedule, AdamW, clipping."""

    steps: int = 200
    """optimizer steps of the whole run (the lr schedule's length)"""
    stop_at: int | None = None
    """end this run after that step, as if interrupted (--resume goes on)"""
    lr: float = 2e-3
    """peak learning rate (the default run's loss at 3e-3 jumped back to ln 256 during warmup, step 15)"""
    min_lr: float = 2e-4
    """learning rate at the end of the cosine decay"""
    warmup: int = 40
    """steps of linear warmup"""
    weight_decay: float = 0.1
    """AdamW's weight decay"""
    clip: float = 1.0
    """global grad-norm clip (0: off)"""
    seed: int = 1234
    """model init and data order"""

    @property
    def last_step(self) -> int:
        """The step this run ends after (``--stop-at``, else ``--steps``)."""
        return min(self.steps, self.stop_at or self.steps)


@dataclass(frozen=True)
class DataConfig:
    """What each step reads: Shakespeare's bytes (``data/``), or your files (``--data``: ``data/tokens.py``)."""

    global_batch: int = 16
    """samples per step, over all DP ranks"""
    eval_every: int = 0
    """steps between validation losses on held-out text, through the pipeline (0: none); with --data, on
    --val-data"""
    data: tuple[str, ...] = field(default=(), metadata={"nargs": "+", "metavar": "PATH[:WEIGHT]"})
    """train on these local files or folders (.txt, .jsonl with a text field or chat messages, .parquet, a
    datasets save_to_disk folder), tokenized once (ndweave.data.prepare) and cached; several as a mixture, each PATH:WEIGHT (default weight
    1); default: Shakespeare's bytes"""
    tokenizer: str = field(default="", metadata={"metavar": "DIR"})
    """a local Hugging Face tokenizer folder (tokenizer.json / tokenizer_config.json) for --data; default:
    the --init-from folder when it holds one, else bytes (ids 0..255)"""
    packing: str = field(default="auto", metadata={"choices": ("auto", "concat", "documents", "first_fit", "none")})
    """how --data's documents fill samples: documents (positions restart per document, attention and loss
    never cross one), concat (back to back), first_fit (whole documents, padded), none (one per sample,
    padded); auto: documents, first_fit for chat (SFT) data"""
    val_data: tuple[str, ...] = field(default=(), metadata={"nargs": "+", "metavar": "PATH"})
    """--eval-every's held-out files with --data (prepared alike, read in order)"""
    data_cache: str = field(default="", metadata={"metavar": "DIR"})
    """where --data's token shards are kept (default: CHECKPOINT_DIR/prepared); a second run reuses them"""
    data_workers: int = 1
    """processes tokenizing --data (rank 0; the shards are the same for any number)"""
    allow_data_change: bool = False
    """resume a checkpoint although its data or tokenizer differ (their hashes) from this run's"""


@dataclass(frozen=True)
class CheckpointConfig:
    """Where the run is saved, when, and whether it resumes."""

    checkpoint_dir: str = "checkpoints/gpt"
    """the run's checkpoints (a folder per step) and its config.json"""
    checkpoint_every: int = 100
    """steps between checkpoints (0: only at the end)"""
    resume: str = field(default="auto", metadata={"const": "always", "choices": ("auto", "always", "never")})
    """continue from the newest complete checkpoint in --checkpoint-dir: always (bare --resume), never, or auto
    (default): when torchrun has restarted the job"""
    export_hf: str = field(default="", metadata={"metavar": "DIR"})
    """at the end, write the trained hf: model as a transformers checkpoint folder
    (AutoModelForCausalLM.from_pretrained(DIR) loads it)"""


@dataclass(frozen=True)
class MetricsConfig:
    """What the run shows and writes (rank 0)."""

    jsonl: str = field(default="gpt_metrics.jsonl", metadata={"flag": "--metrics", "metavar": "FILE"})
    """JSON line per step, appended by rank 0: loss, val_loss, lr, grad_norm, tokens_s, step_s, data_s (reading
    the batch), peak_bytes ('' for none)"""
    tensorboard: str = field(default="", metadata={"metavar": "DIR"})
    """also write the metrics as TensorBoard event files in DIR (needs the tensorboard package)"""
    plot: str = "gpt_loss.png"
    """loss-curve PNG ('' for none)"""
    sample: int = field(default=0, metadata={"const": 300})
    """print this many bytes the pipelined model generates at the end"""
    compare_single_device: bool = False
    """also train the same steps on one process in float64 and compare strictly (a run in fp32 or bf16: the
    same run again in float64 on the same mesh is compared, its own difference printed); exit 1 if they differ"""
    quiet: bool = False
    """no progress bar or report (tests)"""
    verbose: bool = False
    """on a failure, also torch's launcher's own logs and its report (ChildFailedError, per-rank blocks);
    without it a failing job ends in one line: the rank, what failed, the fix"""


@dataclass(frozen=True)
class FaultConfig:
    """(tests) Fault injection for the elastic tests (:mod:`ndweave_gpt.faults`)."""

    kill_rank: int | None = None
    """(tests) this rank SIGKILLs itself, first attempt only"""
    kill_at_step: int = 1
    """(tests) ... as this step begins"""
    kill_in_save: bool = False
    """(tests) ... inside this step's checkpoint save"""


@dataclass(frozen=True)
class JobConfig:
    """The whole run's settings, by concern."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    def replace(self, **changes: Any) -> JobConfig:
        """A copy with ``changes``, each named as its field is in its group (``mesh=``, ``n_layer=``)."""
        groups: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            group = _GROUP_OF.get(name)
            if group is None:
                raise TypeError(f"JobConfig has no field {name!r}")
            groups.setdefault(group, {})[name] = value
        return dataclasses.replace(self, **{g: dataclasses.replace(getattr(self, g), **c) for g, c in groups.items()})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The settings by group, as JSON takes them (an hf: model's config as its ``model_type``)."""
        out = {}
        for group in dataclasses.fields(self):
            values = dataclasses.asdict(dataclasses.replace(getattr(self, group.name), **(
                {"hf_config": None} if group.name == "model" else {})))
            if group.name == "model":
                values["hf_config"] = None if self.model.hf_config is None else self.model.hf_config.model_type
            out[group.name] = values
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def describe(self) -> str:
        """The settings as text: a line per group, ``field=value`` each."""
        return "\n".join(f"  {group}: " + " ".join(f"{k}={v!r}" for k, v in values.items())
                         for group, values in self.to_dict().items())


_CLASSES = {"parallel": ParallelConfig, "plan": PlanConfig, "model": ModelConfig, "training": TrainingConfig,
            "data": DataConfig, "checkpoint": CheckpointConfig, "metrics": MetricsConfig, "faults": FaultConfig}
_GROUP_OF = {f.name: group for group, cls in _CLASSES.items() for f in dataclasses.fields(cls)}


def field_docs(cls: type) -> dict[str, str]:
    """``{field: its docstring}`` of a dataclass: the string right under each field (Megatron's style),
    read from the class's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _flag_type(annotation: Any) -> Any:
    """The type argparse converts a flag's value to: the annotation, ``X`` of ``X | None``."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The job's command line, a flag per field of every group, in the groups' order."""
    parser = argparse.ArgumentParser(prog="python -m ndweave_gpt", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for group, cls in _CLASSES.items():
        section = parser.add_argument_group(f"{group} ({cls.__name__})", (cls.__doc__ or "").strip())
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            meta = f.metadata
            flag = meta.get("flag", "--" + f.name.replace("_", "-"))
            if flag is None:
                continue
            kind = _flag_type(hints[f.name])
            options: dict[str, Any] = {"dest": f.name, "default": f.default, "help": docs.get(f.name)}
            if kind is bool:
                options["action"] = "store_true"
            else:
                options["type"] = str if typing.get_origin(kind) is tuple else kind
                for key in ("choices", "metavar", "nargs"):  # nargs: a tuple of values, ``--data a.jsonl b/``
                    if key in meta:
                        options[key] = list(meta[key]) if key == "choices" else meta[key]
                if "const" in meta:
                    options.update(nargs="?", const=meta["const"])
            section.add_argument(flag, **options)
    return parser


def flag_name(name: str) -> str:
    """The flag of field ``name`` (``tp_plan`` -> ``--plan``)."""
    cls = _CLASSES[_GROUP_OF[name]]
    meta = next(f.metadata for f in dataclasses.fields(cls) if f.name == name)
    return meta.get("flag", "--" + name.replace("_", "-"))


def parse_args(argv: list[str] | None = None, description: str | None = None) -> JobConfig:
    """The job's config from its command line; values the job cannot run are refused as argparse refuses
    a bad flag (one error naming it, on every rank alike, before any process group exists)."""
    parser = build_parser(description)
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(parser.parse_args(argv)).items()}
    config = JobConfig(**{group: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
                          for group, cls in _CLASSES.items()})
    problem = check(config)
    if problem:
        parser.error(problem)
    config, problem = resolve_data(config)
    if problem:
        parser.error(problem)
    config, problem = resolve_model(config)
    if problem:
        parser.error(problem)
    problem = check_device(config)
    if problem:
        parser.error(problem)
    return config


def check(config: JobConfig) -> str | None:
    """Values argparse's types let through that the job cannot run, in words naming the flag (None: none)."""
    model, data, training = config.model, config.data, config.training
    at_least = {"n_layer": 1, "n_embd": 1, "n_head": 1, "block_size": 1, "vocab_size": 0, "steps": 1,
                "global_batch": 1, "micro_batches": 1, "virtual_chunks": 1, "warmup": 0, "checkpoint_every": 0, "sample": 0, "eval_every": 0,
                "moe_experts": 0, "moe_top_k": 1, "lr": 0, "min_lr": 0, "weight_decay": 0, "clip": 0}
    for name, low in at_least.items():
        value = getattr(getattr(config, _GROUP_OF[name]), name)
        if value < low or (name == "lr" and value == 0):
            bound = "positive" if name == "lr" else f"at least {low}"
            return f"{flag_name(name)} must be {bound}, got {value}"
    for name in ("timeout", "compile_timeout"):
        if getattr(config.parallel, name) <= 0:
            return f"{flag_name(name)} must be a positive number of seconds, got {getattr(config.parallel, name)}"
    if model.n_embd % model.n_head:
        return f"--n-embd {model.n_embd} must be a multiple of --n-head {model.n_head} (the head size)"
    if model.moe_experts and model.moe_top_k > model.moe_experts:
        return (f"--moe-top-k {model.moe_top_k} is more than --moe-experts {model.moe_experts}: each token needs "
                "top-k distinct experts")
    if data.eval_every and data.data and not data.val_data:
        return ("--eval-every with --data evaluates on held-out files: pass --val-data PATH (the job holds out "
                "no part of --data)")
    if data.eval_every and not data.data and data.global_batch > VALIDATION_WINDOWS:
        return (f"--eval-every evaluates a --global-batch of held-out samples: at most {VALIDATION_WINDOWS}, "
                f"got {data.global_batch}")
    if training.stop_at is not None and not 1 <= training.stop_at <= training.steps:
        return f"--stop-at must be between 1 and --steps {training.steps}, got {training.stop_at}"
    if config.metrics.tensorboard and importlib.util.find_spec("tensorboard") is None:
        return (f"--tensorboard {config.metrics.tensorboard}: the tensorboard package is not installed; "
                "`pip install tensorboard`, or leave the flag out (--metrics writes every step as JSON lines)")
    return None


def resolve_data(config: JobConfig) -> tuple[JobConfig, str | None]:
    """``--data`` and its flags together: the tokenizer folder resolved (``--tokenizer``, else the
    ``--init-from`` folder's), the vocabulary of a model built here (nanogpt, an hf: preset) sized to it,
    the flags it cannot run with refused."""
    data, model = config.data, config.model
    if not data.data:
        given = [f for f, v in (("--tokenizer", data.tokenizer), ("--val-data", data.val_data),
                                ("--data-cache", data.data_cache), ("--packing", data.packing != "auto"),
                                ("--allow-data-change", data.allow_data_change)) if v]
        if given:
            return config, f"{given[0]} goes with --data (without it the job trains on Shakespeare's bytes)"
        return config, None
    if data.data_workers < 1:
        return config, f"--data-workers must be at least 1, got {data.data_workers}"
    tokenizer = data.tokenizer
    if tokenizer and not os.path.isdir(tokenizer):
        return config, f"--tokenizer {tokenizer}: no such folder (a Hugging Face tokenizer folder: tokenizer.json)"
    beside = ("tokenizer.json", "tokenizer_config.json")  # a pretrained folder's tokenizer
    if not tokenizer and model.init_from and any(os.path.isfile(os.path.join(model.init_from, n)) for n in beside):
        tokenizer = model.init_from
    folder = bool(model.init_from) and os.path.isdir(model.init_from)
    nanogpt = model.name == "nanogpt" and not folder
    vocab_size = model.vocab_size
    preset = not folder and (nanogpt or model.config in hf.PRESETS)  # a model built here: sized to the tokenizer
    if preset and tokenizer and not vocab_size:
        from ndweave.data import TextTokenizer
        from ndweave_gpt.data.tokens import load_tokenizer  # the tokenizer packages only when asked for

        vocab_size = TextTokenizer(load_tokenizer(tokenizer)[0]).vocab_size
    return config.replace(tokenizer=tokenizer, vocab_size=vocab_size), None


def resolve_model(config: JobConfig) -> tuple[JobConfig, str | None]:
    """``--model``, ``--config``, ``--init-from`` and ``--export-hf`` together: the config with an hf:
    model's transformers config read (so a bad one fails before any process group) and ``--model``
    naming its type, or a problem in words."""
    model, export = config.model, config.checkpoint.export_hf
    folder = bool(model.init_from) and os.path.isdir(model.init_from)
    if model.init_from and not folder and not os.path.isfile(model.init_from):
        return config, f"--init-from {model.init_from}: no such folder or file"
    name = "hf:" if folder and model.name == "nanogpt" else model.name  # a folder's config.json names the type
    if name != "nanogpt" and not name.startswith("hf:") or name == "hf:" and not folder:
        return config, f"--model {name}: use nanogpt or hf:<model_type> (hf:llama, hf:qwen2, hf:mixtral, ...)"
    if name == "nanogpt":
        if export:
            return config, ("--export-hf writes a transformers model: train one with --model hf:<model_type> "
                            "(nanogpt's checkpoints export as torch files: ndweave.checkpoint.export)")
        return config, None
    if model.moe_experts and (folder or model.config not in hf.PRESETS):
        return config, "--moe-experts sizes a preset (--config tiny|small); a config.json says its own experts"
    hf_config = hf.hf_config(name[3:] or None, model.config, block_size=model.block_size,
                             moe_experts=model.moe_experts, moe_top_k=model.moe_top_k,
                             init_from=model.init_from if folder else None, bytes_data=not config.data.tokenizer,
                             vocab_size=model.vocab_size)
    return config.replace(name="hf:" + hf_config.model_type, hf_config=hf_config), None


def check_device(config: JobConfig) -> str | None:
    device = config.parallel.device
    if device != "cpu":
        module = getattr(torch, device.split(":")[0], None)
        if module is None or not hasattr(module, "is_available") or not module.is_available():
            return f"--device {device}: no such device is available here; use --device cpu"
    return None


def num_experts(config: JobConfig) -> int:
    """Experts per MoE layer of the job's model (0: dense)."""
    model = config.model
    return hf.experts_of(model.hf_config) if model.hf_config is not None else model.moe_experts
