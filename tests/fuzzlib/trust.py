"""Issue 26's fuzz families: what a region's lossy storage may reach, and dynamic shapes.

* **outside** (:func:`outside_program`): a region whose policy keeps some ops' outputs as
  bf16 (``SaveWithHooks``) or offloads them, its outputs - hooked values among them - read
  by ops outside every region and by a second region that saves exactly. The program
  without regions is the oracle: every gradient that does not flow back through the lossy
  region (the parameters used after it) must be exact, eager and compiled, and the outputs
  must be exact; the rest must stay within a sanity bound of it (bf16's error, amplified).
* **dynamic** (the same programs, ``dynamic=True``, three batch sizes, one compiled
  function): the same checks at each size, and every value the report says was packed by
  the policy's hooks is the output of an op the policy hooks (a decision lands on the op it
  was asked about, whatever SymInt nodes the policy's own size test adds).

Programs are drawn with ``random.Random(seed)``: a failure prints its seed and source.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

# (key, template, aten op it dispatches): one input ``{a}`` of shape (n, 16); ``{w}`` a
# (16, 16) weight
_BODY_OPS = [
    ("mm", "{o} = {a} @ {w}", "aten.mm.default"),
    ("sin", "{o} = {a}.sin()", "aten.sin.default"),
    ("tanh", "{o} = {a}.tanh()", "aten.tanh.default"),
    ("relu", "{o} = {a}.relu() + 0.1 * {a}", "aten.relu.default"),
    ("sigmoid", "{o} = {a}.sigmoid()", "aten.sigmoid.default"),
    ("mul", "{o} = {a} * {b}", "aten.mul.Tensor"),
    ("gelu", "{o} = torch.nn.functional.gelu({a})", "aten.gelu.default"),
    ("cos", "{o} = {a}.cos()", "aten.cos.default"),
]
_OPINIONS = ["HOOKS", "HOOKS", "CP.MUST_CPU_OFFLOAD", "CP.PREFER_CPU_OFFLOAD"]
_OTHERS = ["None", "CP.PREFER_SAVE", "CP.MUST_SAVE", "CP.PREFER_RECOMPUTE"]
_POST = ["{o} = {a} @ w3", "{o} = ({a} * {b}).sin()", "{o} = {a}.tanh() @ w3",
         "{o} = {a}.exp().mean(dim=0, keepdim=True) * {a}"]

_HEADER = '''\
import torch
from sac_compile import CheckpointPolicy as CP, SaveWithHooks, sac_region

aten = torch.ops.aten


def to_bf16(t):
    return t.to(torch.bfloat16)


def from_bf16(packed):
    return packed.float()


HOOKS = SaveWithHooks(to_bf16, from_bf16)
HOOKED = {hooked}


def lossy(ctx, op, *args, **kwargs):
    if op in HOOKED{size_test}:
        return {opinion}
    return {others}


def exact(ctx, op, *args, **kwargs):
    return CP.MUST_SAVE if op is aten.mm.default else None
'''


@dataclasses.dataclass
class TrustProgram:
    seed: int
    source: str
    hooked: tuple[str, ...]     # the ATen ops the lossy policy stores off the device
    lossy_hooks: bool           # its opinion is SaveWithHooks (not an offload)

    def __repr__(self) -> str:
        return f"TrustProgram(seed={self.seed}, source='''\n{self.source}''')"


def outside_program(seed: int) -> TrustProgram:
    rng = random.Random(seed)
    ops = [rng.choice(_BODY_OPS) for _ in range(rng.randint(2, 5))]
    hooked = sorted({op for _, _, op in ops if rng.random() < 0.6} or {ops[0][2]})
    opinion = rng.choice(_OPINIONS)
    size_test = rng.choice(["", "", f" and ctx.op_output.numel() > {rng.choice([64, 200])}"])
    lines, scope = [], ["h"]
    for i, (_, template, _) in enumerate(ops):
        lines.append("    " + template.format(o=f"v{i}", a=scope[-1] if rng.random() < 0.7
                                              else rng.choice(scope),
                                              b=rng.choice(scope), w="w1"))
        scope.append(f"v{i}")
    values = scope[1:]
    outs = sorted({rng.choice(values) for _ in range(rng.randint(1, 3))} | {values[-1]},
                  key=values.index)
    body = ["@sac_region(lossy, name='lossy')", "def first(h, w1):", *lines,
            f"    return ({', '.join(outs)},)", ""]
    second = ["@sac_region(exact, name='exact')", "def second(a, w2):",
              "    return (a @ w2).sin() @ w2", ""]
    pre = rng.choice(["h = x", "h = (x @ w0).tanh()", "h = x + x.sin() @ w0"])
    post, names = [], [f"outs[{i}]" for i in range(len(outs))]
    for j in range(rng.randint(1, 3)):
        post.append("    " + rng.choice(_POST).format(o=f"y{j}", a=rng.choice(names),
                                                       b=rng.choice(names)))
        names.append(f"y{j}")
    uses_second = rng.random() < 0.6
    tail = [f"    z = second({rng.choice(names)}, w2)" if uses_second else "    z = w2.sum()"]
    loss_terms = " + ".join([f"{n}.pow(2).sum()" for n in names] + ["z.pow(2).sum()"])
    program = ["def program(x, w0, w1, w2, w3):", f"    {pre}", "    outs = first(h, w1)",
               *post, *tail, f"    return {loss_terms}", ""]
    source = "\n".join([_HEADER.format(hooked="{" + ", ".join(hooked) + "}",
                                       size_test=size_test, opinion=opinion,
                                       others=rng.choice(_OTHERS)),
                        "", *body, "", *second, "", *program])
    return TrustProgram(seed, source, tuple(hooked), opinion == "HOOKS")


def _load(source: str, *, regions: bool) -> Any:
    namespace: dict[str, Any] = {"__name__": "sac_trust_program"}
    if not regions:
        code = source.replace("@sac_region(lossy, name='lossy')\n", "") \
            .replace("@sac_region(exact, name='exact')\n", "")
    else:
        code = source
    exec(compile(code, "<trust program>", "exec"), namespace)
    return namespace["program"]


def _inputs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    ws = [(torch.randn(16, 16, generator=g) / 4).requires_grad_() for _ in range(4)]
    return [x.requires_grad_(), *ws]


def _step(fn: Any, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for t in inputs:
        t.grad = None
    loss = fn(*inputs)
    loss.backward()
    return loss.detach(), [torch.zeros_like(t) if t.grad is None else t.grad.clone()
                           for t in inputs]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# gradients that flow back through the lossy region (x, w0, w1) and those that do not
_UPSTREAM, _DOWNSTREAM = (0, 1, 2), (3, 4)


def check(program: TrustProgram, *, dynamic: bool = False,
          sizes: tuple[int, ...] = (8,)) -> str | None:
    """None, or what went wrong (the program's seed and source are the repro)."""
    import sac_compile as sc
    plain = _load(program.source, regions=False)
    regioned = _load(program.source, regions=True)
    reports: list[Any] = []
    torch._dynamo.reset()
    compiled = torch.compile(regioned, dynamic=dynamic or None, backend=sc.make_backend(
        compiler="aot_eager", on_partition=reports.append))
    for n in sizes:
        inputs = _inputs(n, program.seed)
        want_loss, want = _step(plain, inputs)
        for mode, fn in (("eager", regioned), ("compiled", compiled)):
            try:
                loss, got = _step(fn, inputs)
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                return f"{mode} (batch {n}) raised {type(e).__name__}: {e}"
            if _rel(loss, want_loss) > 1e-5:
                return f"{mode} (batch {n}): loss {loss.item()} != {want_loss.item()}"
            for i in _DOWNSTREAM:
                if _rel(got[i], want[i]) > 1e-5:
                    return (f"{mode} (batch {n}): the gradient of input {i}, which does not "
                            f"flow through the lossy region, is off by {_rel(got[i], want[i]):.2e}")
            # bf16's error through the lossy region's backward (a sanity bound: eager and
            # compiled may pack different values, and gelu/relu kinks amplify it)
            bound = 0.3 if program.lossy_hooks else 1e-5
            for i in _UPSTREAM:
                if _rel(got[i], want[i]) > bound:
                    return (f"{mode} (batch {n}): the gradient of input {i} is off by "
                            f"{_rel(got[i], want[i]):.2e} (bound {bound})")
    hooked = set(program.hooked)
    for report in reports:
        for record in report.saved:
            if "SaveWithHooks by policy" in record.reason and record.op not in hooked:
                return (f"the report says {record.name} ({record.op}) was packed by the "
                        f"policy's hooks, but the policy hooks only {sorted(hooked)}")
    return None


def campaign(n: int, seed: int, *, dynamic: bool = False) -> tuple[int, list[str]]:
    """Run ``n`` programs from ``seed``; returns (programs run, failure texts)."""
    failures = []
    for k in range(n):
        program = outside_program(seed * 100_000 + k)
        why = check(program, dynamic=dynamic, sizes=(8, 12, 16) if dynamic else (8,))
        if why is not None:
            failures.append(f"{why}\n{program!r}")
    return n, failures
