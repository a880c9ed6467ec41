"""The examples in the public names' docstrings run, and print what they show (eager, CPU,
small: well under a second each). Every name listed must have at least one example."""
import doctest

import pytest

import sac_compile
from sac_compile import policies

PUBLIC = {"sac_region": sac_compile.sac_region, "tag": sac_compile.tag,
          "compose": policies.compose, "explain": sac_compile.explain}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_docstring_examples_run(name):
    tests = [t for t in doctest.DocTestFinder(recurse=False).find(PUBLIC[name], name)
             if t.examples]
    assert tests, f"{name} has no docstring example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    failed, tried = runner.summarize(verbose=False)
    assert tried > 0 and failed == 0, f"{name}: {failed} of {tried} examples failed"
