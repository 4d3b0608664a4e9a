"""Executors: how a StepPlan gets run on the device (now, or overlapped with host work); see base.py."""

from __future__ import annotations

from conveyor.model.runner import ModelRunner
from conveyor.runtime.base import Executor, StepHandle
from conveyor.runtime.trace import Tracer

__all__ = ["Executor", "StepHandle", "make_executor"]


def make_executor(async_batching: bool, runner: ModelRunner, tracer: Tracer) -> Executor:
    """The synchronous executor, or the device's way to overlap: CUDA streams, or a host thread on CPU;
    around it, under tensor parallelism, the executor that also ends the worker processes."""
    executor = _device_executor(async_batching, runner, tracer)
    if runner.config.tensor_parallel_size > 1:
        from conveyor.runtime.tp_executor import TensorParallelExecutor
        from conveyor.tensor_parallel.launch import TensorParallelRunner

        assert isinstance(runner, TensorParallelRunner)
        return TensorParallelExecutor(executor, runner)
    return executor


def _device_executor(async_batching: bool, runner: ModelRunner, tracer: Tracer) -> Executor:
    if not async_batching:
        from conveyor.runtime.sync import SyncExecutor

        return SyncExecutor(runner, tracer)
    if runner.info.is_cuda:
        from conveyor.runtime.cuda_streams import CudaStreamsExecutor

        return CudaStreamsExecutor(runner, tracer)
    from conveyor.runtime.cpu_overlap import CpuOverlapExecutor

    return CpuOverlapExecutor(runner, tracer)
