"""Fixtures every test file shares.

* ``fresh_dynamo`` (autouse): each test starts and ends with ``torch._dynamo.reset()``, so
  no compiled code, guard or recompile count leaks from one test into the next. A module
  whose tests share something Dynamo compiled once (a module-scoped fixture holding a
  compiled model) opts out with ``pytestmark = pytest.mark.keep_dynamo`` (a test with
  ``@pytest.mark.keep_dynamo``); a test that compiles twice on purpose still resets in
  between itself. The fixture also fails a test that leaves compiled autograd enabled,
  and turns it off, so the next test runs with the plain engine; likewise a test that
  leaves a profiler running (the next test's measured peaks would be nested in it).
* ``capture``: a fresh :class:`fixtures.capture.Captured`; ``capture.backend(...)`` is
  ``make_backend(compiler="aot_eager", on_partition=...)`` and ``capture.reports`` every
  PartitionReport it produced (``capture.report``, the last; ``capture.fw``/``bw``, the
  last split's graphs).
"""
from __future__ import annotations

import sys

import pytest
import torch


def _compiled_autograd_left_on() -> list[str]:
    """What of compiled autograd a test left switched on: ``compiled_autograd._enable``
    (or a ``torch.compile`` under ``compiled_autograd=True``) not exited, or Dynamo's
    ``compiled_autograd`` config set without a restore. Each is process-wide: the next
    test's backward would run through compiled autograd."""
    left = []
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is not None and (getattr(ca, "compiled_autograd_enabled", False)
                           or getattr(ca, "in_compiled_autograd_region", False)):
        left.append("compiled autograd enabled")
    if "torch._dynamo" in sys.modules and torch._dynamo.config.compiled_autograd:
        left.append("torch._dynamo.config.compiled_autograd = True")
    return left


def _turn_compiled_autograd_off() -> None:
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is not None:
        ca.in_compiled_autograd_region = False  # (reset() refuses to run inside one)
        ca.reset()
    torch._dynamo.config.compiled_autograd = False


def _profiler_left_on() -> bool:
    from sac_compile.torch_internals import profiler_enabled
    return bool(profiler_enabled())


def _stop_profilers() -> None:
    while _profiler_left_on():
        try:
            torch.autograd.profiler._disable_profiler()
        except Exception:  # noqa: BLE001 - nothing more to stop
            return


@pytest.fixture(autouse=True)
def fresh_dynamo(request: pytest.FixtureRequest):
    keep = request.node.get_closest_marker("keep_dynamo") is not None
    if not keep and "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    yield
    if _profiler_left_on():
        _stop_profilers()
        pytest.fail("the test left a torch.profiler running (now stopped): the next "
                    "test's measured peaks would be nested in it")
    left_on = _compiled_autograd_left_on()
    if left_on:
        _turn_compiled_autograd_off()
    if not keep and "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    assert not left_on, f"the test left {' and '.join(left_on)} (now turned off)"


@pytest.fixture
def capture():
    from fixtures.capture import Captured  # (imports the compiler: only where a test asks)
    return Captured()
