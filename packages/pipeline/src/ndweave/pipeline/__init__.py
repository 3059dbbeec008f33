"""ndweave.pipeline: pipeline parallelism over the "PP" dim of a mesh, on torch's pipelining schedules.

    module = construct_pipeline_stage(model, PipelineParallelPlan(num_microbatches=4), mesh, example_inputs=x[:2])
    engine = PipeEngine(module, mesh, loss_fn)
    loss = engine(x, y)           # forward + backward of the mini-batch, every PP rank gets the loss
    val = engine.evaluate(x, y)   # forward only
    tokens = generate(engine, prompt, max_new_tokens=20)
"""

from ndweave.pipeline.construct import PipeModule, StagePlaceholder, construct_pipeline_stage
from ndweave.pipeline.engine import PipeEngine
from ndweave.pipeline.generate import generate
from ndweave.pipeline.faults import Failure, PipelineStageError
from ndweave.pipeline.plan import SCHEDULE_NAMES, PipelineParallelPlan
from ndweave.pipeline.report import PipelineReport, StageReport
from ndweave.pipeline.split import model_layers
from ndweave.pipeline.stage_io import CrossingValue, StageIO
from ndweave.pipeline.ties import SharedParam
from ndweave.pipeline.timeline import Action, ScheduleTimeline

__version__ = "0.8.4"

__all__ = [
    "Action",
    "CrossingValue",
    "Failure",
    "PipeEngine",
    "PipeModule",
    "PipelineParallelPlan",
    "PipelineReport",
    "PipelineStageError",
    "SCHEDULE_NAMES",
    "ScheduleTimeline",
    "SharedParam",
    "StageIO",
    "StageReport",
    "StagePlaceholder",
    "__version__",
    "construct_pipeline_stage",
    "generate",
    "model_layers",
]
