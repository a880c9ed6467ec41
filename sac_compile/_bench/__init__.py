"""Private: the measuring harness behind ``python -m sac_compile report`` and ``make demo``.

* :mod:`.models`: the built-in reference models (MLP, GPT, conv, MoE) at test and bench sizes.
* :mod:`.measure`: saved bytes with and without torch's checkpointing, op counts, timing.
* :mod:`.strategies`: the strategies compared, as wrappers of a model's blocks.
* :mod:`.partition_figures`: what each compiled split saves, for upstream's partitioner and ours.
* :mod:`.runner`: every strategy on one model, one row each.

Not public API. The tests and benchmarks reach it through the repository's ``fixtures``
package; the library's own modules (policy, regions, runtime, compiler) never import it.
"""
