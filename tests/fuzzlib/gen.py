"""Hypothesis strategies for random small programs over ATen ops with random SAC regions.

A program is rendered to Python source (see :mod:`.harness` for what the source may use).
Every choice is a hypothesis draw, so a failing program shrinks: fewer statements, shallower
regions, simpler ops (each list below starts with its simplest entry) and simpler policies.

Values: ``f`` float (4, 8), ``i`` int64 (4,) in [0, 8), ``m`` bool (4, 8). Inputs: x, y (f,
requiring grad), w (8, 8) and b (8,) parameters, idx (i), and buffers buf, rm, rv updated in
place.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from hypothesis import strategies as st

# (key, input types, output types, template, flags). Templates use {o} (the float/int/bool
# output), {o2} (a second output), {a} {b} {c} (inputs). Flags: "inplace" (mutates),
# "random", "notag" (identity of the result is lost to a mutation through a view),
# "dropout" (F.dropout: eager and compile see different ATen ops).
OPS: list[tuple[str, str, str, str, frozenset]] = []


def _op(key: str, ins: str, outs: str, template: str, *flags: str) -> None:
    OPS.append((key, ins, outs, template, frozenset(flags)))


# pointwise
_op("sin", "f", "f", "{o} = {a}.sin()")
_op("mul", "ff", "f", "{o} = {a} * {b}")
_op("add", "ff", "f", "{o} = {a} + {b}")
_op("cos", "f", "f", "{o} = {a}.cos()")
_op("relu", "f", "f", "{o} = torch.relu({a})")
_op("tanh", "f", "f", "{o} = torch.tanh({a})")
_op("sigmoid", "f", "f", "{o} = torch.sigmoid({a})")
_op("gelu", "f", "f", "{o} = F.gelu({a})")
_op("silu", "f", "f", "{o} = F.silu({a})")
_op("exp", "f", "f", "{o} = torch.exp({a}.clamp(-4.0, 4.0))")
_op("affine", "f", "f", "{o} = {a} * 0.5 + 0.25")
_op("sub", "ff", "f", "{o} = {a} - {b}")
_op("div", "ff", "f", "{o} = {a} / (1.5 + {b} * {b})")
_op("maximum", "ff", "f", "{o} = torch.maximum({a}, {b})")
_op("neg", "f", "f", "{o} = -{a}")
# matmuls
_op("mm", "f", "f", "{o} = {a} @ w")
_op("linear", "f", "f", "{o} = F.linear({a}, w, b)")
_op("mm3", "fff", "f", "{o} = ({a} @ {b}.t()) @ {c}")
_op("bmm", "f", "f", "{o} = torch.bmm({a}.reshape(2, 2, 8), w.expand(2, 8, 8)).reshape(4, 8)")
_op("matmul", "ff", "f", "{o} = torch.matmul({a}, w.t()) + {b}")
# reductions
_op("rowsum", "ff", "f", "{o} = {a} * {b}.sum(-1, keepdim=True)")
_op("center", "f", "f", "{o} = {a} - {a}.mean(0, keepdim=True)")
_op("softmax", "f", "f", "{o} = torch.softmax({a}, -1)")
_op("amax", "ff", "f", "{o} = {a}.amax(-1, keepdim=True) * {b}")
_op("var_mean", "f", "f", "_v, _m = torch.var_mean({a}, -1, keepdim=True)\n"
                          "{o} = ({a} - _m) / (_v + 1.0)")
# views
_op("view_t", "f", "f", "{o} = {a}.reshape(8, 4).t()")
_op("transpose", "f", "f", "{o} = {a}.unsqueeze(0).transpose(0, 1).squeeze(1)")
_op("slice_cat", "f", "f", "{o} = torch.cat([{a}[:, 4:], {a}[:, :4]], 1)")
_op("expand", "ff", "f", "{o} = {a}[:1].expand(4, 8) + {b}")
_op("select", "ff", "f", "{o} = {b} * {a}[2]")
# in-place
_op("add_", "ff", "f", "{o} = {a} * 1.0\n{o}.add_({b})", "inplace")
_op("mul_", "ff", "f", "{o} = {a}.clone()\n{o}.mul_({b})", "inplace")
_op("copy_", "ff", "f", "{o} = torch.empty_like({a})\n{o}.copy_({b})\n{o}.mul_({a})", "inplace")
_op("view_mul_", "ff", "f", "{o} = {a}.clone()\n{o}[:, :4].mul_({b}[:, 4:])", "inplace", "notag")
_op("relu_", "f", "f", "{o} = {a}.sin()\n{o}.relu_()", "inplace")
_op("sigmoid_", "f", "f", "{o} = {a} + 0.0\n{o}.sigmoid_()", "inplace")
# multi-output
_op("split", "f", "f", "{o} = torch.cat({a}.split(3, -1)[::-1], -1)")
_op("unbind", "f", "f", "{o} = torch.stack({a}.unbind(0)[::-1])")
_op("topk", "f", "fi", "_v, _i = {a}.topk(4, -1)\n{o} = torch.cat([_v, _v.flip(-1)], -1)\n"
                       "{o2} = _i[:, 0]")
_op("layer_norm", "f", "f", "{o} = F.layer_norm({a}, (8,))")
_op("layer_norm_affine", "f", "f", "{o} = F.layer_norm({a}, (8,), w[0], b)")
_op("max_dim", "ff", "f", "_mx, _ = {a}.max(-1, keepdim=True)\n{o} = {b} * _mx")
_op("sort", "ff", "f", "{o} = {a}.sort(-1).values * {b}")
# random
_op("dropout", "f", "f", "{o} = F.dropout({a}, 0.3, training=True)", "random", "dropout")
_op("native_dropout", "f", "f", "{o} = torch.ops.aten.native_dropout({a}, 0.3, True)[0]",
    "random")
_op("rand_like", "f", "f", "{o} = {a} * torch.rand_like({a})", "random")
_op("randn_like", "f", "f", "{o} = {a} + 0.1 * torch.randn_like({a})", "random")
_op("bernoulli", "f", "f", "{o} = {a} * torch.bernoulli(torch.full_like({a}, 0.5))", "random")
# integer and bool tensors
_op("argmax", "f", "i", "{o} = {a}.argmax(-1)")
_op("index_select", "fi", "f", "{o} = w.index_select(0, {b}) * {a}")
_op("embedding", "if", "f", "{o} = F.embedding({a}, w) + {b}")
_op("gather", "fi", "f", "{o} = {a}.gather(1, {b}.unsqueeze(1).expand(4, 8))")
_op("int_arith", "i", "i", "{o} = ({a} + 3) % 8")
_op("mask", "f", "m", "{o} = {a} > 0")
_op("where", "mff", "f", "{o} = torch.where({a}, {b}, {c})")
_op("masked_fill", "fm", "f", "{o} = {a}.masked_fill({b}, 0.0)")
_op("mul_mask", "fm", "f", "{o} = {a} * {b}")
# a parameter with buffers updated in place
_op("buf_update", "f", "", "buf.mul_(0.9).add_({a}.detach().mean(0), alpha=0.1)", "inplace")
_op("buf_read", "f", "f", "{o} = {a} + buf")
_op("batch_norm", "f", "f", "{o} = F.batch_norm({a}, rm, rv, training=True, momentum=0.1)",
    "inplace")
# in-place on an existing value (autograd may refuse: such programs are rejected)
_op("mutate", "f", "", "{a}.mul_(1.5)", "inplace", "mutate")

OP_KEYS = [o[0] for o in OPS]
GLOBALS = ("w", "b", "buf", "rm", "rv")
OP_BY_KEY = {o[0]: o for o in OPS}

# ATen ops policies may name (the first entries are the common ones)
POLICY_OPS = ["aten.mm.default", "aten.sin.default", "aten.mul.Tensor", "aten.add.Tensor",
              "aten.relu.default", "aten.cos.default", "aten.addmm.default",
              "aten.bmm.default", "aten.cat.default", "aten.native_layer_norm.default",
              "aten.topk.default", "aten.gelu.default", "aten.tanh.default",
              "aten.index_select.default", "aten.where.self", "aten.add_.Tensor",
              "aten.mul_.Tensor", "aten.native_dropout.default", "aten.rand_like.default",
              "aten.view.default", "aten.t.default", "aten.split.Tensor",
              "aten.embedding.default", "aten.sigmoid.default", "aten.sum.dim_IntList",
              "aten._softmax.default", "aten.native_batch_norm.default"]
PACKETS = ["aten.mm", "aten.add", "aten.mul", "aten.sin", "aten.native_layer_norm"]
OPINIONS = ["None", "CP.PREFER_RECOMPUTE", "CP.PREFER_SAVE", "CP.MUST_SAVE",
            "CP.MUST_RECOMPUTE", "CP.PREFER_CPU_OFFLOAD", "CP.MUST_CPU_OFFLOAD", "True", "False",
            "HOOKS"]
TAG_OPINIONS = OPINIONS[1:]
LABELS = ["a", "b"]


@dataclasses.dataclass
class Program:
    source: str
    n_ops: int = 0
    n_regions: int = 0
    depth: int = 0
    inplace: bool = False
    random: bool = False
    dropout: bool = False
    foreign_tag: bool = False   # a tag/name inside a region on a value from outside it
    tags: int = 0

    def __repr__(self) -> str:  # hypothesis prints the falsifying example with this
        return f"Program(source='''\n{self.source}''')"


@dataclasses.dataclass
class _Var:
    name: str
    type: str
    region: int      # id of the outermost region it was produced in (0: outside)
    notag: bool = False


class _Gen:
    def __init__(self, draw: Any, *, max_top: int, max_body: int, max_depth: int,
                 ops: list[str], foreign_tags: bool, bare_tags: bool, safe_tags: bool) -> None:
        self.draw = draw
        self.safe_tags = safe_tags
        self.body_start: list[int] = []
        self.max_top, self.max_body, self.max_depth = max_top, max_body, max_depth
        self.ops = ops
        self.foreign_tags = foreign_tags
        self.bare_tags = bare_tags
        self.nvar = 0
        self.nregion = 0
        self.policies: list[str] = []
        self.regions: list[str] = []  # rendered region functions
        self.prog = Program("")
        self.outer_id = 0
        self.outer_count = 0

    def fresh(self) -> str:
        self.nvar += 1
        return f"v{self.nvar}"

    def pick(self, scope: list[_Var], t: str, used: set[str]) -> _Var | None:
        cands = [v for v in scope if v.type == t]
        if not cands:
            return None
        v = self.draw(st.sampled_from(cands))
        used.add(v.name)
        return v

    def emit(self, scope: list[_Var], used: set[str], lines: list[str], indent: str,
             ins: Any, outs: Any, template: str, flags: Any) -> bool:
        """One op from its template on variables drawn from ``scope``, its outputs new
        variables; False (nothing emitted) when ``scope`` lacks an input of a needed type."""
        args = []
        for t in ins:
            v = self.pick(scope, t, used)
            if v is None:
                return False
            args.append(v.name)
        names = dict(zip("abc", args))
        new = [self.fresh() for _ in outs]
        if new:
            names["o"] = new[0]
        if len(new) > 1:
            names["o2"] = new[1]
        text = template.format(**names)
        used.update(n for n in GLOBALS if re.search(rf"\b{n}\b", text))
        for line in text.split("\n"):
            lines.append(indent + line)
        for n, t in zip(new, outs):
            scope.append(_Var(n, t, self.outer_id, "notag" in flags))
        return True

    # -- statements ----------------------------------------------------------------
    def op(self, scope: list[_Var], used: set[str], lines: list[str], indent: str) -> None:
        key = self.draw(st.sampled_from(self.ops))
        _, ins, outs, template, flags = OP_BY_KEY[key]
        if "mutate" in flags:
            if self.draw(st.integers(0, 3)):
                return  # rarer: autograd refuses many such programs
            cands = [v for v in scope if v.type == "f" and v.name not in ("x", "y")]
            if not cands:
                return
            a = self.draw(st.sampled_from(cands))
            used.add(a.name)
            lines.append(indent + template.format(a=a.name))
            used.update(n for n in GLOBALS if re.search(rf"\b{n}\b", template))
            self.prog.inplace = True
            self.prog.n_ops += 1
            return
        if not self.emit(scope, used, lines, indent, ins, outs, template, flags):
            return
        self.prog.n_ops += 1
        self.prog.inplace |= "inplace" in flags
        self.prog.random |= "random" in flags
        self.prog.dropout |= "dropout" in flags

    def tag(self, scope: list[_Var], used: set[str], lines: list[str], indent: str,
            in_region: bool) -> None:
        # In a region, target a value the current outermost region produced, unless foreign
        # tags are on (the eager runtime raises for those).
        own = [v for v in scope if v.region == self.outer_id and self.outer_id and not v.notag]
        if self.safe_tags:
            # Only inside a region, on a value this very region body defined (the tags the
            # compile path agreed with eager on before markers carried their region).
            if not in_region:
                return
            own = [v for v in scope[self.body_start[-1]:] if not v.notag and v.type != "p"]
        foreign = in_region and self.foreign_tags and not self.safe_tags and self.draw(st.integers(0, 15)) == 15
        cands = scope if (not in_region or foreign) else own
        cands = [v for v in cands if not v.notag and v.type != "p"]
        if not cands:
            return
        v = self.draw(st.sampled_from(cands))
        used.add(v.name)
        if in_region and v not in own:
            self.prog.foreign_tag = True
        if self.draw(st.booleans()):
            opinion = self.draw(st.sampled_from(TAG_OPINIONS))
            call = f"tag({v.name}, {opinion})"
        else:
            call = f"name({v.name}, {self.draw(st.sampled_from(LABELS))!r})"
        self.prog.tags += 1
        if self.bare_tags and self.draw(st.booleans()):
            lines.append(indent + call)
        else:
            lines.append(indent + f"{v.name} = {call}")

    def policy(self) -> str:
        kind = self.draw(st.sampled_from(["table", "preset", "oplist", "save_ops", "names",
                                          "offload_ops", "reuse"]))
        if kind == "reuse" and self.policies:
            return self.draw(st.sampled_from(self.policies))
        if kind == "preset":
            expr = repr(self.draw(st.sampled_from(["recompute_all", "save_matmuls",
                                                   "save_all"])))
            return expr
        if kind in ("oplist", "save_ops", "offload_ops"):
            ops = self.draw(st.lists(st.sampled_from(POLICY_OPS + PACKETS), min_size=1,
                                     max_size=3, unique=True))
            if kind == "oplist":
                expr = f"[{', '.join(ops)}]"
            else:
                expr = f"preset({kind!r}, {', '.join(ops)})"
        elif kind == "names":
            expr = f"preset('names', {self.draw(st.sampled_from(LABELS))!r})"
        else:
            n = self.draw(st.integers(0, 4))
            table = {}
            for _ in range(n):
                table[self.draw(st.sampled_from(POLICY_OPS))] = self.draw(st.sampled_from(OPINIONS))
            default = self.draw(st.sampled_from(OPINIONS))
            names = {}
            if self.draw(st.integers(0, 3)) == 0:
                names[self.draw(st.sampled_from(LABELS))] = self.draw(st.sampled_from(OPINIONS))
            entries = ", ".join(f"{k}: {v}" for k, v in table.items())
            expr = f"table_policy({{{entries}}}, default={default}"
            if names:
                expr += ", names={" + ", ".join(f"{k!r}: {v}" for k, v in names.items()) + "}"
            expr += ")"
        pname = f"P{len(self.policies) + 1}"
        self.policies.append(pname)
        self.regions_header.append(f"{pname} = {expr}")
        return pname

    def open_region(self, depth: int) -> tuple[int, bool]:
        """A new region's id, and whether it is outermost (then it starts an outer id)."""
        self.nregion += 1
        outermost = depth == 0
        if outermost:
            self.outer_count += 1
            self.outer_id = self.outer_count
        return self.nregion, outermost

    def region_body(self, scope: list[_Var], indent: str,
                    depth: int) -> tuple[list[_Var], set[str], list[str]]:
        """A region's statements (its scope: the caller's, and what it defines), the names
        it reads, its lines."""
        body_scope = list(scope)
        self.body_start.append(len(body_scope))
        body_used: set[str] = set()
        body: list[str] = []
        self.block(body_scope, body_used, body, indent, depth + 1,
                   self.draw(st.integers(1, self.max_body)))
        self.body_start.pop()
        return body_scope, body_used, body

    def region(self, scope: list[_Var], used: set[str], lines: list[str], indent: str,
               depth: int) -> None:
        rid, outermost = self.open_region(depth)
        policy = self.policy()
        named = self.draw(st.booleans())
        allow = self.draw(st.integers(0, 4)) == 0
        body_scope, body_used, body = self.region_body(scope, "    ", depth)
        if not body:
            body.append("    pass")
        defined = [v for v in body_scope if v not in scope]
        params = [v.name for v in scope if v.name in body_used]
        fname = f"r{rid}"
        opts = [policy]
        if named:
            opts.append(f"name='R{rid}'")
        if allow:
            opts.append("allow_cache_entry_mutation=True")
        src = [f"@sac_region({', '.join(opts)})", f"def {fname}({', '.join(params)}):", *body]
        outs = [v.name for v in defined]
        src.append(f"    return ({', '.join(outs)}{',' if outs else ''})")
        self.regions.append("\n".join(src))
        used.update(params)
        target = f"{', '.join(outs)}{',' if outs else ''} = " if outs else ""
        lines.append(f"{indent}{target}{fname}({', '.join(params)})")
        # values a region returns keep their region of origin (tags on them after the
        # region, inside another region, are foreign unless the same outermost region)
        scope.extend(defined)
        self.prog.n_regions += 1
        self.prog.depth = max(self.prog.depth, depth + 1)
        if outermost:
            self.outer_id = 0

    def block(self, scope: list[_Var], used: set[str], lines: list[str], indent: str,
              depth: int, n: int) -> None:
        for _ in range(n):
            choices = ["op", "op", "op", "tag"]
            if depth < self.max_depth:
                choices.append("region")
            choices += self.other_statements(depth)
            kind = self.draw(st.sampled_from(choices))
            if kind == "op":
                self.op(scope, used, lines, indent)
            elif kind == "tag":
                self.tag(scope, used, lines, indent, depth > 0)
            elif kind == "region":
                self.region(scope, used, lines, indent, depth)
            else:
                self.other_statement(kind, scope, used, lines, indent, depth)

    def other_statements(self, depth: int) -> list[str]:
        """Statement kinds a subclass adds at ``depth`` (drawn besides op, tag, region)."""
        return []

    def other_statement(self, kind: str, scope: list[_Var], used: set[str], lines: list[str],
                        indent: str, depth: int) -> None:
        raise AssertionError(f"no statement kind {kind!r}")

    def program(self) -> Program:
        self.regions_header: list[str] = []
        scope = [_Var("x", "f", 0), _Var("y", "f", 0), _Var("idx", "i", 0)]
        scope += [_Var(n, "p", 0) for n in GLOBALS]  # used by templates, never picked
        used: set[str] = set()
        lines: list[str] = []
        # at least one region
        n = self.draw(st.integers(0, self.max_top - 1))
        self.block(scope, used, lines, "    ", 0, n)
        self.region(scope, used, lines, "    ", 0)
        m = self.draw(st.integers(0, 2))
        self.block(scope, used, lines, "    ", 0, m)
        outs = [v.name for v in scope if v.name != "idx" and v.type != "p"]
        header = ["import torch", "import torch.nn.functional as F",
                  "from sac_compile import CheckpointPolicy as CP", "aten = torch.ops.aten", ""]
        src = header + self.regions_header + [""] + [r + "\n" for r in self.regions] + [
            "def program(x, y, w, b, idx, buf, rm, rv):", *lines,
            f"    return ({', '.join(outs)},)", ""]
        self.prog.source = "\n".join(src)
        return self.prog


@st.composite
def programs(draw: Any, *, max_top: int = 5, max_body: int = 4, max_depth: int = 3,
             ops: list[str] | None = None, foreign_tags: bool = True,
             bare_tags: bool = False, safe_tags: bool = False) -> Program:
    """Random programs. ``safe_tags``: tag()/name() only inside a region on a value the
    region body defined. ``bare_tags``: some tag()/name() results are left unused."""
    return _Gen(draw, max_top=max_top, max_body=max_body, max_depth=max_depth,
                ops=ops or OP_KEYS, foreign_tags=foreign_tags, bare_tags=bare_tags,
                safe_tags=safe_tags).program()


# ======================================================================================
# The boundary family: programs that mutate across the region boundary
# ======================================================================================
#
# A boundary program is Python source (see harness.check_boundary) defining
#
#   setup(w, b, buf) -> dict of modules        (optional: module regions, deep copies,
#                                                state-dict round trips)
#   program(mods, x, y, w, b, idx, buf, rm, rv) -> tuple of tensors   (the forward)
#   after(outs, mods, x, y, w, b, idx, buf, rm, rv)   (optional: runs after the loss is
#                                                taken and before backward)
#
# and uses real sac_compile for everything but ``sac_region``, which the namespace gives
# (the real one, or a stub that leaves functions and modules as they are). tag()/name()
# are sac_compile's own: no-ops outside every region, so the reference is plain autograd.
#
# What it draws (each a *feature*, so a campaign can be restricted to one):
#   input_mut   in-place updates of region inputs after the region (``h += r(h)``)
#   output_mut  in-place updates of region outputs and views of them, after the region
#               or in after() (between the loss and backward)
#   foreach     _foreach_* ops (out-of-place and in-place) inside regions; foreach updates
#               of lists at the boundary
#   param_mut   parameters updated in place under no_grad (optimizer-step style) after the
#               region or before backward
#   buffer      buffers read and then updated in place inside a region; buffer updates
#               after the region
#   rrelu       F.rrelu(training=True) (random, and it mutates its noise tensor)
#   grad_mode   torch.no_grad() and torch.inference_mode() blocks inside regions
#   module      module regions: wrapped, deep-copied, state-dict round trips
#   dtype       factory ops inside regions (torch.full, arange, ...) and a default-dtype
#               switch to float64 between forward and backward

FEATURES = ("input_mut", "output_mut", "foreach", "param_mut", "buffer", "rrelu",
            "grad_mode", "module", "dtype")

# (key, ins, outs, template, flags, feature) inside region bodies, on top of OPS
BOUNDARY_OPS: list[tuple[str, str, str, str, frozenset, str]] = []


def _bop(feature: str, key: str, ins: str, outs: str, template: str, *flags: str) -> None:
    BOUNDARY_OPS.append((key, ins, outs, template, frozenset(flags), feature))


_bop("foreach", "foreach_mul", "ff", "f",
     "_fa, _fb = torch._foreach_mul([{a}, {b}], 0.5)\n{o} = _fa * _fb")
_bop("foreach", "foreach_add_list", "ff", "f",
     "_fl = torch._foreach_add([{a}, {b}], [{b}, {a}])\n{o} = _fl[0].sin() + _fl[1]")
_bop("foreach", "foreach_exp", "f", "f", "{o}, = torch._foreach_exp([{a}.clamp(-3.0, 3.0)])")
_bop("foreach", "foreach_add_", "ff", "f", "{o} = {a} * 1.0\ntorch._foreach_add_([{o}], [{b}])",
     "inplace")
_bop("foreach", "foreach_mul_", "ff", "f",
     "{o} = {a}.sin()\n_fo = {b}.cos()\ntorch._foreach_mul_([{o}, _fo], 1.5)\n{o} = {o} * _fo",
     "inplace")
# in-place on an existing value (a region input or an earlier value): "mutate"
_bop("foreach", "foreach_mutate", "f", "", "torch._foreach_add_([{a}], 1.0)", "mutate")
_bop("foreach", "foreach_mutate2", "f", "", "torch._foreach_mul_([{a}], [{a}])", "mutate")
_bop("rrelu", "rrelu", "f", "f", "{o} = F.rrelu({a}, training=True)", "random")
_bop("rrelu", "rrelu_mm", "f", "f", "{o} = F.rrelu({a} @ w, 0.1, 0.4, training=True)", "random")
_bop("grad_mode", "no_grad_add", "ff", "f",
     "with torch.no_grad():\n    _n = {a} * 2.0\n{o} = {b} + _n")
_bop("grad_mode", "no_grad_mul", "ff", "f",
     "with torch.no_grad():\n    _n = {a}.sin()\n{o} = {b} * _n")
_bop("grad_mode", "inference_add", "ff", "f",
     "with torch.inference_mode():\n    _n = {a}.cos()\n{o} = {b} + _n")
_bop("grad_mode", "inference_clone", "ff", "f",
     "with torch.inference_mode():\n    _n = {a}.cos()\n{o} = {b} * _n.clone()")
_bop("grad_mode", "inference_mul", "ff", "f",
     "with torch.inference_mode():\n    _n = {a}.cos()\n{o} = {b} * _n")
_bop("grad_mode", "no_grad_mutate", "f", "", "with torch.no_grad():\n    {a}.mul_(0.5)",
     "mutate")
_bop("grad_mode", "inference_buf", "f", "f",
     "{o} = {a} * buf\nwith torch.inference_mode():\n    buf.add_(0.5)")
_bop("dtype", "full_mul", "f", "f", "{o} = {a} * torch.full((8,), 0.1)")
_bop("dtype", "arange_add", "f", "f", "{o} = ({a} + torch.arange(8.0) / 3).sin()")
_bop("dtype", "linspace_mul", "f", "f", "{o} = {a} * torch.linspace(0.0, 1.0, 8)")
_bop("dtype", "tensor_mul", "f", "f", "{o} = {a} * torch.tensor(0.3)")
_bop("dtype", "ones_div", "f", "f", "{o} = {a} / (torch.ones(4, 8) * 3)")
_bop("dtype", "zeros_like_add", "f", "f", "{o} = ({a} + torch.zeros_like({a}) + 0.1).sin()")
_bop("dtype", "empty_fill", "f", "f", "{o} = {a} * torch.empty(8).fill_(0.7)")
_bop("dtype", "eye_mm", "f", "f", "{o} = {a} @ (torch.eye(8) / 3)")
_bop("dtype", "rand_mul", "f", "f", "{o} = {a} * torch.rand(4, 8)", "random")
_bop("buffer", "buf_read_update", "f", "f", "{o} = {a} * buf\nbuf.add_(0.5)", "inplace")
_bop("buffer", "rv_read", "f", "f", "{o} = {a} * rv")
_bop("buffer", "rm_update", "f", "", "rm.mul_(0.9).add_({a}.detach().mean(0), alpha=0.1)",
     "inplace")

BOUNDARY_OP_BY_KEY = {o[0]: o[:5] for o in BOUNDARY_OPS}
ALL_OP_BY_KEY = {**OP_BY_KEY, **BOUNDARY_OP_BY_KEY}

# in-place updates of a float (4, 8) value at the boundary: {t} the target, {u} another value
MUTATIONS = ["{t}.mul_(1.5)", "{t} += {u}", "{t}.add_({u})", "{t}.relu_()", "{t}.sin_()",
             "{t}[:, :3].mul_(2.0)", "{t}[1].add_(1.0)", "{t}.t()[:2].zero_()",
             "{t}.copy_({u})", "{t}.sigmoid_()"]
FOREACH_MUTATIONS = ["torch._foreach_add_([{t}], 1.0)", "torch._foreach_mul_([{t}, {u}], 1.5)",
                     "torch._foreach_add_([{t}], [{u}])"]
PARAM_MUTATIONS = ["{p}.add_(0.01)", "{p}.mul_(0.9)", "{p}.sub_({p} * 0.1)"]
FOREACH_PARAM_MUTATIONS = ["torch._foreach_add_([w, b], 0.01)", "torch._foreach_mul_([w], 0.9)"]
BUFFER_MUTATIONS = ["{p}.add_(1.0)", "{p}.mul_(0.5)"]
FOREACH_BUFFER_MUTATIONS = ["torch._foreach_add_([rm, rv], 0.5)"]
# how a module region is built in setup(): {P} policy, {R} name, {M} class
MODULE_SETUPS = [
    "m = sac_region({P}, name='{R}')({M}(w, b, buf))",
    "m = copy.deepcopy(sac_region({P}, name='{R}')({M}(w, b, buf)))",
    "m0 = sac_region({P}, name='{R}')({M}(w, b, buf))\nm = copy.deepcopy(m0)",
    "src = sac_region({P}, name='{R}')({M}(w, b, buf))\n"
    "m = sac_region({P}, name='{R}')({M}(w * 0, b * 0, buf * 0))\n"
    "m.load_state_dict(src.state_dict())",
    "src = {M}(w, b, buf)\nm = sac_region({P}, name='{R}')({M}(w * 0, b * 0, buf * 0))\n"
    "m.load_state_dict(src.state_dict())",
    "src = sac_region({P}, name='{R}')({M}(w, b, buf))\nm = {M}(w * 0, b * 0, buf * 0)\n"
    "m.load_state_dict(src.state_dict())\nm = sac_region({P}, name='{R}')(m)",
    "m = sac_region({P}, name='{R}')(copy.deepcopy({M}(w, b, buf)))",
]
B_OPINIONS = ["None", "CP.PREFER_RECOMPUTE", "CP.PREFER_SAVE", "CP.MUST_SAVE", "True", "False",
              "CP.PREFER_CPU_OFFLOAD", "CP.MUST_CPU_OFFLOAD", "HOOKS", "CP.MUST_RECOMPUTE"]


@dataclasses.dataclass
class BoundaryProgram:
    source: str
    features: frozenset = frozenset()   # the features actually drawn
    n_regions: int = 0
    random: bool = False
    has_after: bool = False

    def __repr__(self) -> str:
        return f"BoundaryProgram(source='''\n{self.source}''')"


class _BGen(_Gen):
    def __init__(self, draw: Any, *, features: frozenset, max_top: int, max_body: int,
                 max_depth: int, exclude: frozenset = frozenset()) -> None:
        ops = [k for k in OP_KEYS if k != "dropout"]  # F.dropout: eager/compile differ
        ops += [o[0] for o in BOUNDARY_OPS if o[5] in features]
        ops = [k for k in ops if k not in exclude]
        super().__init__(draw, max_top=max_top, max_body=max_body, max_depth=max_depth,
                         ops=ops, foreign_tags=False, bare_tags=True, safe_tags=False)
        self.features = features
        self.used_features: set[str] = set()
        self.feature_of = {o[0]: o[5] for o in BOUNDARY_OPS}
        self.region_inputs: list[str] = []
        self.region_outputs: list[str] = []
        self.modules: list[str] = []
        self.module_classes: list[str] = []
        self.setup_lines: list[str] = []
        self.random = False

    # -- ops inside regions (and outside) -------------------------------------------
    def op(self, scope: list[_Var], used: set[str], lines: list[str], indent: str) -> None:
        key = self.draw(st.sampled_from(self.ops))
        _, ins, outs, template, flags = ALL_OP_BY_KEY[key]
        if key in self.feature_of:
            self.used_features.add(self.feature_of[key])
        self.random |= "random" in flags
        if "mutate" in flags:
            cands = [v for v in scope if v.type == "f" and v.name not in ("x", "y")]
            if not cands:
                return
            a = self.draw(st.sampled_from(cands))
            used.add(a.name)
            for line in template.format(a=a.name).split("\n"):
                lines.append(indent + line)
            return
        self.emit(scope, used, lines, indent, ins, outs, template, flags)

    # -- policies: real sac_compile policies, so a repro needs no harness ------------
    def policy(self) -> str:
        kind = self.draw(st.sampled_from(["preset", "oplist", "save_ops", "table", "names",
                                          "offload_ops", "reuse"]))
        if kind == "reuse" and self.policies:
            return self.draw(st.sampled_from(self.policies))
        if kind in ("preset", "reuse"):
            return repr(self.draw(st.sampled_from(["recompute_all", "save_matmuls",
                                                   "save_all"])))
        pname = f"P{len(self.policies) + 1}"
        if kind in ("oplist", "save_ops", "offload_ops"):
            ops = ", ".join(self.draw(st.lists(st.sampled_from(POLICY_OPS + PACKETS),
                                               min_size=1, max_size=3, unique=True)))
            expr = f"[{ops}]" if kind == "oplist" else f"sc.policies.{kind}({ops})"
            self.regions_header.append(f"{pname} = {expr}")
        elif kind == "names":
            label = self.draw(st.sampled_from(LABELS))
            self.regions_header.append(f"{pname} = sc.policies.save_only_these_names({label!r})")
        else:
            n = self.draw(st.integers(0, 3))
            table = {}
            for _ in range(n):
                table[self.draw(st.sampled_from(POLICY_OPS))] = \
                    self.draw(st.sampled_from(B_OPINIONS))
            default = self.draw(st.sampled_from(B_OPINIONS))
            entries = ", ".join(f"{k}: {v}" for k, v in table.items())
            self.regions_header.append(
                f"def {pname}(ctx, op, *args, **kwargs):\n"
                f"    return {{{entries}}}.get(op, {default})\n")
        self.policies.append(pname)
        return pname

    # -- regions: functions, or (outermost, feature "module") modules ----------------
    def region(self, scope: list[_Var], used: set[str], lines: list[str], indent: str,
               depth: int) -> None:
        rid, outermost = self.open_region(depth)
        # (the simplest draw, 0, shrinks to a function region without allow_...=True)
        module = outermost and "module" in self.features and self.draw(st.integers(0, 2)) == 2
        policy = self.policy()
        allow = self.draw(st.integers(0, 5)) == 5
        body_scope, body_used, body = self.region_body(scope, "        " if module else "    ",
                                                       depth)
        defined = [v for v in body_scope if v not in scope]
        outs = [v.name for v in defined]
        ret = f"return ({', '.join(outs)}{',' if outs else ''})"
        opts = [policy, f"name='R{rid}'"]
        if allow:
            opts.append("allow_cache_entry_mutation=True")
        if module:
            self.used_features.add("module")
            params = [v.name for v in scope if v.name in body_used and v.name not in
                      ("w", "b", "buf")]
            cls = f"M{rid}"
            self.module_classes.append(
                f"class {cls}(torch.nn.Module):\n"
                f"    def __init__(self, w, b, buf):\n"
                f"        super().__init__()\n"
                f"        self.w = torch.nn.Parameter(w.detach().clone())\n"
                f"        self.b = torch.nn.Parameter(b.detach().clone())\n"
                f"        self.register_buffer('buf', buf.detach().clone())\n\n"
                f"    def forward(self, {', '.join(params)}):\n"
                f"        w, b, buf = self.w, self.b, self.buf\n" + "\n".join(body) +
                f"\n        {ret}\n")
            how = self.draw(st.sampled_from(MODULE_SETUPS))
            mname = f"m{rid}"
            text = how.format(P=policy, R=f"R{rid}", M=cls)
            text = re.sub(r"\bm0\b", f"{mname}_0", text)
            text = re.sub(r"\bsrc\b", f"{mname}_src", text)
            text = re.sub(r"\bm\b", mname, text)
            self.setup_lines += ["    " + t for t in text.split("\n")]
            self.modules.append(mname)
            if f"{mname}_0" in text:
                self.modules.append(f"{mname}_0")
            if f"{mname}_src" in text and "sac_region" in text.split("\n")[0]:
                self.modules.append(f"{mname}_src")
            callee = f"mods[{mname!r}]"
        else:
            params = [v.name for v in scope if v.name in body_used]
            fname = f"r{rid}"
            self.regions.append("\n".join([f"@sac_region({', '.join(opts)})",
                                           f"def {fname}({', '.join(params)}):", *body,
                                           f"    {ret}"]) + "\n")
            callee = fname
        used.update(params)
        target = f"{', '.join(outs)}{',' if outs else ''} = " if outs else ""
        lines.append(f"{indent}{target}{callee}({', '.join(params)})")
        scope.extend(defined)
        self.region_inputs += [p for p in params if p not in self.region_inputs]
        self.region_outputs += [o for o, v in zip(outs, defined) if v.type == "f"]
        if outermost:
            self.outer_id = 0

    # -- boundary mutations ----------------------------------------------------------
    def mutation(self, scope: list[_Var], used: set[str], lines: list[str], indent: str,
                 where: str) -> None:
        """One in-place update at the boundary: ``where`` is "program" (after a region
        call, in the forward) or "after" (between the loss and backward)."""
        floats = [v.name for v in scope if v.type == "f" and v.name not in ("x", "y")]
        kinds = []
        f = self.features
        if "input_mut" in f and any(n in floats for n in self.region_inputs):
            kinds.append("input_mut")
        if "output_mut" in f and any(n in floats for n in self.region_outputs):
            kinds.append("output_mut")
        if "param_mut" in f:
            kinds.append("param_mut")
        if "buffer" in f:
            kinds.append("buffer")
        if "dtype" in f and where == "after":
            kinds.append("dtype")
        if not kinds:
            return
        kind = self.draw(st.sampled_from(kinds))
        self.used_features.add(kind)
        stmt: str
        if kind in ("input_mut", "output_mut"):
            pool = self.region_inputs if kind == "input_mut" else self.region_outputs
            cands = [n for n in pool if n in floats]
            t = self.draw(st.sampled_from(cands))
            others = [n for n in [v.name for v in scope if v.type == "f"] if n != t]
            forms = list(MUTATIONS)
            if "foreach" in f:
                forms += FOREACH_MUTATIONS
            form = self.draw(st.sampled_from(forms))
            if "{u}" in form and not others:
                form = MUTATIONS[0]
            u = self.draw(st.sampled_from(others)) if "{u}" in form else ""
            if form in FOREACH_MUTATIONS:
                self.used_features.add("foreach")
            stmt = form.format(t=t, u=u)
            used.update({t, u} - {""})
            if self.draw(st.integers(0, 3)) == 0:
                stmt = "with torch.no_grad():\n    " + stmt
        elif kind == "param_mut":
            ps = ["w", "b"] + [f"mods[{m!r}].{p}" for m in self.modules for p in ("w", "b")]
            form = self.in_place_form(PARAM_MUTATIONS, FOREACH_PARAM_MUTATIONS, f)
            stmt = "with torch.no_grad():\n    " + form.format(p=self.draw(st.sampled_from(ps)))
        elif kind == "buffer":
            bs = ["buf", "rm", "rv"] + [f"mods[{m!r}].buf" for m in self.modules]
            form = self.in_place_form(BUFFER_MUTATIONS, FOREACH_BUFFER_MUTATIONS, f)
            stmt = form.format(p=self.draw(st.sampled_from(bs)))
        else:
            stmt = "torch.set_default_dtype(torch.float64)"
        for line in stmt.split("\n"):
            lines.append(indent + line)

    def in_place_form(self, plain: Any, foreach: Any, features: Any) -> str:
        """An in-place update's template: one of ``plain``, or of ``foreach`` too when that
        feature is on (then marked used when drawn)."""
        form = self.draw(st.sampled_from(list(plain) + (list(foreach) if "foreach" in features
                                                        else [])))
        if form in foreach:
            self.used_features.add("foreach")
        return form

    def other_statements(self, depth: int) -> list[str]:
        return ["mutation"] if self.region_inputs or self.region_outputs or depth == 0 else []

    def other_statement(self, kind: str, scope: list[_Var], used: set[str], lines: list[str],
                        indent: str, depth: int) -> None:
        # inside a region body only value updates (a nested region's boundary)
        saved = self.features
        if depth > 0:
            self.features = saved & {"input_mut", "output_mut", "foreach"}
        self.mutation(scope, used, lines, indent, "program")
        self.features = saved

    def program(self) -> BoundaryProgram:  # type: ignore[override]
        self.regions_header: list[str] = []
        scope = [_Var("x", "f", 0), _Var("y", "f", 0), _Var("idx", "i", 0)]
        scope += [_Var(n, "p", 0) for n in GLOBALS]
        used: set[str] = set()
        lines: list[str] = []
        # a first non-leaf value, so region inputs can be updated in place
        first = self.draw(st.sampled_from(["x * 1.0", "x.clone()", "x.sin()", "x @ w"]))
        lines.append(f"    v0 = {first}")
        scope.append(_Var("v0", "f", 0))
        self.block(scope, used, lines, "    ", 0, self.draw(st.integers(0, self.max_top - 1)))
        self.region(scope, used, lines, "    ", 0)
        self.block(scope, used, lines, "    ", 0, self.draw(st.integers(0, 3)))
        outs = [v.name for v in scope if v.name != "idx" and v.type != "p"]
        after: list[str] = []
        for _ in range(self.draw(st.integers(0, 2))):
            self.mutation(scope, set(), after, "    ", "after")
        src = ["import copy", "import torch", "import torch.nn.functional as F",
               "import sac_compile as sc", "from sac_compile import CheckpointPolicy as CP",
               "aten = torch.ops.aten", "", *self.regions_header, "",
               *[r + "\n" for r in self.regions], *[c + "\n" for c in self.module_classes]]
        if self.modules:
            src += ["def setup(w, b, buf):", *self.setup_lines,
                    "    return {" + ", ".join(f"{m!r}: {m}" for m in self.modules) + "}",
                    "", ""]
        src += ["def program(mods, x, y, w, b, idx, buf, rm, rv):", *lines,
                f"    return ({', '.join(outs)},)", ""]
        if after:
            src += ["", "def after(outs, mods, x, y, w, b, idx, buf, rm, rv):",
                    f"    {', '.join(outs)}, = outs", *after, ""]
        return BoundaryProgram("\n".join(src), frozenset(self.used_features),
                               self.nregion, self.random, bool(after))


@st.composite
def boundary_programs(draw: Any, *, features: frozenset | tuple = FEATURES, max_top: int = 4,
                      max_body: int = 4, max_depth: int = 2,
                      exclude: frozenset | tuple = ()) -> BoundaryProgram:
    """Random programs that update values in place across the region boundary.
    ``exclude``: op keys (OPS, BOUNDARY_OPS) never drawn."""
    return _BGen(draw, features=frozenset(features), max_top=max_top, max_body=max_body,
                 max_depth=max_depth, exclude=frozenset(exclude)).program()


# ======================================================================================
# The cache family: policies that read a value, and a persistent cache shared across
# processes (harness.check_cache_batch)
# ======================================================================================
#
# A cache program is a module (written to a file, imported by name, so that its policy has
# source and a stable qualified name, as a user's has) defining ``POLICY``, ``body(x, y, w,
# b)`` (plain ops, no regions) and ``region``, ``body`` made a region with ``POLICY``. The
# policy decides one drawn op (``TARGET``) by a value it reads; every other op gets one drawn
# opinion (``OTHERS``). Where the value comes from is the *kind*, one of CACHE_KINDS; which
# value it is depends on the environment variable SAC_FUZZ_CACHE_PHASE (0: the first
# process's value, 1: the second's, always different). The harness compiles it in one
# process, then in another with the other value and the same TORCHINDUCTOR_CACHE_DIR:
# that split must be a cold compile's.
#
# A separate generator path: programs() and boundary_programs() draw exactly as before.

CACHE_KINDS = ("global dict", "enum", "object attribute", "helper function", "os.environ",
               "closure cell", "functools.partial", "class instance", "globals() call",
               "dataclass method", "environ staticmethod", "ClassVar", "method call",
               "enum member", "declared")
# what has a proven identity (then a changed value is a new cache key: the user's
# cache_hash names the value) and what has none (every other policy of a user's: the
# persistent caches are bypassed) - README, "Policy identity"
CACHE_NAMED = ("declared",)
CACHE_UNNAMED = tuple(k for k in CACHE_KINDS if k not in CACHE_NAMED)
# the values a policy reads: the opinion each gives the target op ("bf16": SaveWithHooks
# that store it in bfloat16, so a stale split also shows in the gradients)
CACHE_VALUES = ("bf16", "save", "recompute", "prefer_save", "none")
CACHE_OTHERS = ("CP.PREFER_RECOMPUTE", "None", "CP.PREFER_SAVE")
# the ATen op the value decides on -> op keys (OPS) whose template dispatches it
CACHE_TARGETS = {"aten.mm.default": ("mm", "mm3"), "aten.addmm.default": ("linear",),
                 "aten.bmm.default": ("bmm",), "aten.sin.default": ("sin",),
                 "aten.mul.Tensor": ("mul",), "aten.tanh.default": ("tanh",),
                 "aten.add.Tensor": ("add",), "aten.sigmoid.default": ("sigmoid",),
                 "aten.cos.default": ("cos",), "aten.relu.default": ("relu",)}
# ops whose backward reads their first input, put after the target op
CACHE_CONSUMERS = ["sin", "mul", "tanh", "cos", "sigmoid", "gelu", "silu", "mm", "div"]
# body ops: deterministic, out of place, float in and out, reading no buffer
CACHE_BODY_OPS = [k for k, ins, outs, template, flags in OPS
                  if not flags and outs == "f" and set(ins) <= {"f"}
                  and not re.search(r"\b(buf|rm|rv)\b", template)]


@dataclasses.dataclass
class CacheProgram:
    source: str
    kind: str
    target: str
    values: tuple        # (process 1's value, process 2's)
    via_helper: bool     # the value is read through a helper function the policy calls

    @property
    def named(self) -> bool:
        return self.kind in CACHE_NAMED

    def named_as(self, name: str) -> CacheProgram:
        """The same program, its region named ``name``."""
        source = re.sub(r"^REGION_NAME = .*$", f"REGION_NAME = {name!r}", self.source,
                        count=1, flags=re.M)
        return dataclasses.replace(self, source=source)

    def __repr__(self) -> str:
        return (f"CacheProgram(kind={self.kind!r}, target={self.target!r}, "
                f"values={self.values!r}, source='''\n{self.source}''')")


_CACHE_HEADER = '''\
import dataclasses
import enum
import functools
import os
import typing

import torch
import torch.nn.functional as F
from sac_compile import CheckpointPolicy as CP, SaveWithHooks, sac_region

aten = torch.ops.aten
PHASE = int(os.environ.get("SAC_FUZZ_CACHE_PHASE", "0"))
REGION_NAME = {name!r}


def to_bf16(t):
    return t.to(torch.bfloat16)


def from_bf16(packed):
    return packed.float()


OPINIONS = {{"bf16": SaveWithHooks(to_bf16, from_bf16), "save": CP.MUST_SAVE,
            "recompute": CP.MUST_RECOMPUTE, "prefer_save": CP.PREFER_SAVE, "none": None}}
TARGET = {target}
OTHERS = {others}
VALUE = {values!r}[PHASE]


def decide(value, op):
    return OPINIONS[value] if op is TARGET else OTHERS
'''

# how each kind holds VALUE and how its policy reads it: (setup, read expression, policy)
# {read} is the expression giving the value inside the policy (or inside the helper)
_CACHE_KIND_SOURCES = {
    "global dict": ('CFG = {{"checkpoint": {{"{key}": VALUE}}}}', 'CFG["checkpoint"]["{key}"]',
                    "function"),
    "enum": ("class Mode(enum.Enum):\n" +
             "".join(f"    {v.upper()} = {v!r}\n" for v in CACHE_VALUES) +
             "\n\nMODE = Mode(VALUE)", "MODE.value", "function"),
    "object attribute": ("class Settings:\n    pass\n\n\nSETTINGS = Settings()\n"
                         "SETTINGS.{key} = VALUE", "SETTINGS.{key}", "function"),
    "helper function": ("_VALUE = VALUE\n\n\ndef current_value():\n    return _VALUE",
                        "current_value()", "function"),
    "os.environ": ('os.environ["SAC_FUZZ_{KEY}_" + REGION_NAME] = VALUE',
                   'os.environ["SAC_FUZZ_{KEY}_" + REGION_NAME]', "function"),
    "closure cell": ("", "value", "closure"),
    "functools.partial": ("", "value", "partial"),
    "class instance": ("", "self.value", "instance"),
    # the routes issue 26 found past the inspecting rule
    "globals() call": ('globals()["VALUE_{KEY}"] = VALUE', 'globals()["VALUE_{KEY}"]',
                       "function"),
    "dataclass method": ("_HELD = VALUE\n\n\n@dataclasses.dataclass(frozen=True)\n"
                         "class Reader:\n    def current(self):\n        return _HELD\n\n\n"
                         "READER = Reader()", "READER.current()", "function"),
    "environ staticmethod": ('os.environ["SAC_FUZZ_S_{KEY}_" + REGION_NAME] = VALUE\n\n\n'
                             "@dataclasses.dataclass(frozen=True)\nclass Env:\n"
                             "    @staticmethod\n    def current():\n"
                             '        return os.environ["SAC_FUZZ_S_{KEY}_" + REGION_NAME]',
                             "Env.current()", "function"),
    "ClassVar": ("", "self.value", "classvar"),
    "method call": ("_HELD = VALUE", "_HELD", "method"),
    "enum member": ("_HELD = VALUE", "_HELD", "enum"),
    "declared": ("", "VALUE", "declared"),
}


def _cache_policy_source(kind: str, key: str, via_helper: bool) -> str:
    setup, read, form = _CACHE_KIND_SOURCES[kind]
    setup = setup.format(key=key, KEY=key.upper())
    read = read.format(key=key, KEY=key.upper())
    lines = [setup, "", ""] if setup else []
    if form == "function":
        if via_helper:
            lines += ["def read_value():", f"    return {read}", "", "",
                      "def policy(ctx, op, *args, **kwargs):",
                      "    return decide(read_value(), op)", "", "",
                      "POLICY = policy"]
        else:
            lines += ["def policy(ctx, op, *args, **kwargs):",
                      f"    return decide({read}, op)", "", "", "POLICY = policy"]
    elif form == "closure":
        lines += ["def make_policy(value):", "    def policy(ctx, op, *args, **kwargs):",
                  f"        return decide({read}, op)", "", "    return policy", "", "",
                  "POLICY = make_policy(VALUE)"]
    elif form == "partial":
        lines += ["def policy(value, ctx, op, *args, **kwargs):",
                  f"    return decide({read}, op)", "", "",
                  "POLICY = functools.partial(policy, VALUE)"]
    elif form == "classvar":
        lines += ["@dataclasses.dataclass(frozen=True)", "class Policy:",
                  "    value: typing.ClassVar[str] = 'none'", "",
                  "    def __call__(self, ctx, op, *args, **kwargs):",
                  f"        return decide({read}, op)", "", "",
                  "Policy.value = VALUE", "POLICY = Policy()"]
    elif form == "method":
        lines += ["@dataclasses.dataclass(frozen=True)", "class Policy:",
                  "    def __call__(self, ctx, op, *args, **kwargs):",
                  "        return self.pick(op)", "",
                  "    def pick(self, op):", f"        return decide({read}, op)", "", "",
                  "POLICY = Policy()"]
    elif form == "enum":
        lines += ["class Policy(enum.Enum):", "    ONLY = 1", "",
                  "    def __call__(self, ctx, op, *args, **kwargs):",
                  f"        return decide({read}, op)", "", "", "POLICY = Policy.ONLY"]
    elif form == "declared":
        lines += ["def policy(ctx, op, *args, **kwargs):", f"    return decide({read}, op)",
                  "", "", 'policy.cache_hash = "fuzz-policy-" + VALUE', "POLICY = policy"]
    else:
        lines += ["class Policy:", "    def __init__(self, value):",
                  "        self.value = value", "",
                  "    def __call__(self, ctx, op, *args, **kwargs):",
                  f"        return decide({read}, op)", "", "",
                  "POLICY = Policy(VALUE)"]
    return "\n".join(lines)


@st.composite
def cache_programs(draw: Any, *, kinds: tuple = CACHE_KINDS, max_ops: int = 5,
                   name: str = "R") -> CacheProgram:
    """A program whose policy reads a value of a kind drawn from ``kinds``; ``name``: its
    region's name (unique among the programs one process runs: the bypass line is said
    once per name)."""
    kind = draw(st.sampled_from(list(kinds)))
    target = draw(st.sampled_from(list(CACHE_TARGETS)))
    first = draw(st.sampled_from(CACHE_VALUES))
    second = draw(st.sampled_from([v for v in CACHE_VALUES if v != first]))
    others = draw(st.sampled_from(CACHE_OTHERS))
    via_helper = _CACHE_KIND_SOURCES[kind][2] == "function" and kind != "helper function" \
        and draw(st.booleans())
    key = draw(st.sampled_from(["lossy", "mode", "mm_policy", "flag"]))
    # the body: n ops, one of which dispatches the target and the next reads its output
    # with an op whose backward needs it (so that saving or recomputing it is a choice)
    n = draw(st.integers(2, max(2, max_ops)))
    at = draw(st.integers(0, n - 2))
    scope = ["x", "y"]
    lines: list[str] = []
    for i in range(n):
        if i == at:
            key_op = draw(st.sampled_from(list(CACHE_TARGETS[target])))
        elif i == at + 1:
            key_op = draw(st.sampled_from(CACHE_CONSUMERS))
        else:
            key_op = draw(st.sampled_from(CACHE_BODY_OPS))
        _, ins, _, template, _ = OP_BY_KEY[key_op]
        names = {"o": f"v{i + 1}"}
        for slot in "abc"[:len(ins)]:
            names[slot] = scope[-1] if i == at + 1 and slot == "a" else \
                draw(st.sampled_from(scope))
        lines += ["    " + line for line in template.format(**names).split("\n")]
        scope.append(f"v{i + 1}")
    # the last value and some others, never the target's (a region output is kept for the
    # caller anyway, so no policy could change whether it is saved)
    outs = [v for v in scope[2:-1] if v != f"v{at + 1}" and draw(st.booleans())] + [scope[-1]]
    src = [_CACHE_HEADER.format(target=target, others=others, values=(first, second),
                                name=name),
           "", _cache_policy_source(kind, key, via_helper), "", "",
           "def body(x, y, w, b):", *lines, f"    return ({', '.join(outs)},)", "", "",
           "region = sac_region(POLICY, name=REGION_NAME)(body)", ""]
    return CacheProgram("\n".join(src), kind, target, (first, second), via_helper)


def cache_batch(n: int, *, seed: int = 0, kinds: tuple = CACHE_KINDS) -> list:
    """``n`` cache programs drawn from a fixed seed, as evenly spread over ``kinds`` as
    ``n`` allows (so a batch of len(kinds) has one of each), their regions named R0, R1,
    .... Every example draws the same way; which are kept depends only
    on what was drawn (hypothesis replays draws, so they may not depend on outside
    state)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed

    quota = -(-n // len(kinds))
    drawn: list[CacheProgram] = []

    @fixed_seed(seed)
    @settings(max_examples=max(100, 40 * n), database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(cache_programs(kinds=kinds))
    def draw(program: CacheProgram) -> None:
        drawn.append(program)

    draw()
    # hypothesis draws its simplest programs first; take them in the order of a hash of
    # their text instead (fixed by the seed, spread over the whole run)
    import hashlib
    drawn.sort(key=lambda p: hashlib.sha256(p.source.encode()).hexdigest())
    out: list[CacheProgram] = []
    seen: set[str] = set()
    per_kind: dict = {}
    for program in drawn:
        if len(out) == n:
            break
        if program.source in seen or per_kind.get(program.kind, 0) >= quota:
            continue
        seen.add(program.source)
        per_kind[program.kind] = per_kind.get(program.kind, 0) + 1
        out.append(program.named_as(f"R{len(out)}"))
    if len(out) < n:
        raise RuntimeError(f"cache_batch: only {len(out)} distinct programs of {n} drawn")
    return out
