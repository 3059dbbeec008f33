"""A minimal test double of the ``GradBucketProvider`` contract (what ``ndweave.ddp`` implements).

``FakeDDP`` lays a model's trainable params out in flat per-bucket buffers exactly as the contract
says: ``param_data`` views *are* the params' local tensors (for a DTensor its ``_local_tensor``),
every bucket's numel is padded to a multiple of the DP size, and ``finish_grad_sync()`` copies the
grads into ``grad_data``, averages over DP and reduce-scatters (``use_distributed_optimizer=True``)
or all-reduces (then points each ``p.grad`` at its reduced range). No overlap, no hooks: the tests
of ``ndweave.optim`` need only the layout and the numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ndweave.mesh.contracts import BucketParam, GradBucket, reduce_partial_grads


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class FakeDDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, dp_group: dist.ProcessGroup | None, *, bucket_numel: int = 64,
                 use_distributed_optimizer: bool = True, grad_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.module = module
        self.use_distributed_optimizer = use_distributed_optimizer
        self.dp_group = dp_group
        self.dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # greedy buckets of about bucket_numel elements, one dtype per bucket
        chunks, chunk, size = [], [], 0
        for name, p in named:
            if chunk and (size >= bucket_numel or _local(p).dtype != _local(chunk[0][1]).dtype):
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append((name, p))
            size += _local(p).numel()
        if chunk:
            chunks.append(chunk)
        self._buckets = [self._make_bucket(chunk, grad_dtype) for chunk in chunks]

    def _make_bucket(self, chunk, grad_dtype) -> GradBucket:
        numel = sum(_local(p).numel() for _, p in chunk)
        padded = -(-numel // self.dp_size) * self.dp_size
        dtype = _local(chunk[0][1]).dtype
        device = _local(chunk[0][1]).device
        param_data = torch.zeros(padded, dtype=dtype, device=device)
        grad_data = torch.zeros(padded, dtype=grad_dtype or dtype, device=device)
        params, offset = [], 0
        with torch.no_grad():
            for name, p in chunk:
                local = _local(p)
                n = local.numel()
                param_data[offset : offset + n].copy_(local.reshape(-1))
                view = param_data[offset : offset + n].view(local.shape)
                if isinstance(p, DTensor):
                    local.set_(param_data.untyped_storage(), param_data.storage_offset() + offset, local.shape,
                               view.stride())
                else:
                    p.data = view
                params.append(BucketParam(name=name, param=p, offset=offset, numel=n))
                offset += n
        return GradBucket(params=tuple(params), grad_data=grad_data,
                          param_data=param_data if self.use_distributed_optimizer else None,
                          data_parallel_group=self.dp_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def grad_buckets(self):
        return self._buckets

    def finish_grad_sync(self) -> None:
        reduce_partial_grads(self.module.parameters())
        for bucket in self._buckets:
            for bp in bucket.params:
                dst = bucket.grad_data[bp.offset : bp.offset + bp.numel]
                if bp.param.grad is not None:
                    dst.copy_(_local(bp.param.grad).reshape(-1))
            if self.dp_size > 1:
                bucket.grad_data.div_(self.dp_size)
                if self.use_distributed_optimizer:
                    start, end = bucket.shard_range()
                    dist.reduce_scatter_tensor(bucket.grad_data[start:end], bucket.grad_data.clone(),
                                               group=self.dp_group)
                else:
                    dist.all_reduce(bucket.grad_data, group=self.dp_group)
            if not self.use_distributed_optimizer:
                for bp in bucket.params:
                    reduced = bucket.grad_data[bp.offset : bp.offset + bp.numel].view(_local(bp.param).shape)
                    grad = bp.param.grad
                    if isinstance(grad, DTensor):
                        grad._local_tensor.copy_(reduced)
                    elif grad is not None:
                        grad.copy_(reduced)

    def zero_grad_buffer(self) -> None:
        for bucket in self._buckets:
            bucket.grad_data.zero_()
            for bp in bucket.params:
                bp.param.grad = None
