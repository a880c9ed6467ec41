"""SACPartitioner pickles without its unpicklable callback; reports go to ``sac_partition``."""
from __future__ import annotations

import logging
import pickle

import torch

from sac_compile import policies, sac_region
from sac_compile.compiler import SACPartitioner, make_backend
from sac_compile.logs import partition_log


def _module_level_callback(report):  # picklable by reference
    pass


def test_pickling_drops_an_unpicklable_callback_only():
    seen = []

    def local(report):
        seen.append(report)

    p = pickle.loads(pickle.dumps(SACPartitioner(on_partition=local, memory_budget=0.5)))
    assert p.on_partition is None and p.memory_budget == 0.5
    assert p.uuid() == SACPartitioner(memory_budget=0.5).uuid()
    q = pickle.loads(pickle.dumps(SACPartitioner(on_partition=_module_level_callback)))
    assert q.on_partition is _module_level_callback


def _tiny():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    sac_region(policies.save_matmuls)(model)
    return model, torch.randn(4, 8, requires_grad=True)


def test_inductor_cache_pickling_a_local_callback_prints_nothing(capfd):
    got = []

    def local(report):
        got.append(report)

    model, x = _tiny()
    torch.compile(model, backend=make_backend(on_partition=local))(x).sum().backward()
    assert len(got) == 1
    err = capfd.readouterr().err
    assert "pickle" not in err.lower() and "Traceback" not in err, err[-2000:]


def test_each_report_goes_to_the_partition_artifact():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, level = Keep(), partition_log.level
    partition_log.addHandler(handler)
    partition_log.setLevel(logging.DEBUG)
    try:
        model, x = _tiny()
        torch.compile(model, backend=make_backend(compiler="aot_eager"))(x).sum().backward()
    finally:
        partition_log.removeHandler(handler)
        partition_log.setLevel(level)
    assert len(records) == 1 and records[0].startswith("PartitionReport (compile)")
