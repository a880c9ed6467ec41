"""What a user does *around* an eager region: in-place updates of its inputs, outputs,
parameters and buffers between forward and backward, list and hidden mutation, and the
state (grad mode, default dtype) backward runs under.

The contract: the gradients of the same program without checkpointing, or a
CheckpointError that names the op, the region, the tensor and the fix. Never silent.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import sac_compile as sc
from sac_compile import CheckpointError, CheckpointPolicy, policies


def identity(policy=None, **kwargs):
    return lambda fn: fn


def grads(program, wrap, seed=0):
    """Run ``program(wrap)`` from ``seed``; it returns (loss, leaves); backward on loss."""
    torch.manual_seed(seed)
    loss, leaves = program(wrap)
    loss.backward()
    return [t.grad for t in leaves]


def assert_same_gradients(program, seed=0):
    ref = grads(program, identity, seed)
    ours = grads(program, sc.sac_region, seed)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def plain_autograd_raises(program):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grads(program, identity)


def leaves():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    return x, w


# -- 1. in-place residual on a region input ------------------------------------------------

@pytest.mark.parametrize("first_op", ["scale", "dropout", "positional_add"])
def test_in_place_residual_on_a_region_input_raises_instead_of_replaying_the_new_value(first_op):
    pos = torch.randn(4, 8)

    def program(wrap):
        x, w = leaves()

        @wrap("recompute_all")
        def block(h):
            if first_op == "scale":
                h = h * 2.0
            elif first_op == "dropout":
                h = F.dropout(h, 0.5)
            else:
                h = h + pos
            return (h @ w).sin()

        h = x * 1.0
        h += block(h)  # plain autograd: right, nothing it saved is h
        return h.sum(), (x, w)

    grads(program, identity)
    with pytest.raises(CheckpointError, match=r"recomputing aten\.\w+\.\w+ \(op #0 of region "
                       r"'[^']*block'\) needs argument 0, a \(4, 8\) float32 tensor.*modified in place "
                       r"after the region read it.*h = h \+ block\(h\)"):
        grads(program, sc.sac_region)


def test_out_of_place_residual_gives_the_gradients_of_no_checkpointing():
    def program(wrap):
        x, w = leaves()
        block = wrap("recompute_all")(lambda h: ((h * 2.0) @ w).sin())
        h = x * 1.0
        h = h + block(h)
        return h.sum(), (x, w)

    assert_same_gradients(program)


def test_region_input_modified_after_autograd_saved_it_raises_like_plain_autograd():
    def program(wrap):
        x, w = leaves()
        block = wrap("recompute_all")(lambda h: (h @ w).sin())  # mm saves h
        h = x * 1.0
        h += block(h)
        return h.sum(), (x, w)

    plain_autograd_raises(program)
    # sin's backward comes first: it recomputes mm from h and finds h modified
    with pytest.raises(CheckpointError, match=r"aten\.mm\.default \(op #0 of region "
                       r"'[^']*<lambda>'\) needs argument 0, a \(4, 8\) float32 tensor.*"
                       r"modified in place after the region read it \(version 0 -> 1\)"):
        grads(program, sc.sac_region)


# -- 2. in-place on a returned output the policy saved -------------------------------------

@pytest.mark.parametrize("mutation", ["iadd", "relu_", "view_mul_"])
def test_in_place_on_a_returned_output_the_policy_saved_raises(mutation):
    def program(wrap):
        x, w = leaves()

        @wrap(policies.save_matmuls)
        def block(x):
            h = x @ w
            return h, h.sin()  # sin's backward reads h: the saved matmul

        h, s = block(x)
        if mutation == "iadd":
            h += 1
        elif mutation == "relu_":
            h.relu_()
        else:
            h[:, :3].mul_(2)
        return (h + s).sum(), (x, w)

    plain_autograd_raises(program)
    with pytest.raises(CheckpointError, match=r"output 0 of aten\.mm\.default \(op #0 of region "
                       r"'[^']*block'\), a \(4, 8\) float32 tensor the policy saved for backward, was "
                       r"modified in place after the region returned it.*Clone it"):
        grads(program, sc.sac_region)


def test_in_place_on_a_returned_output_that_is_recomputed_gives_the_unmodified_gradient():
    """Plain autograd raises here (sin saved h); the region recomputes h from unmodified
    inputs, which is the gradient of what the program computed."""
    def program(wrap):
        x, w = leaves()
        block = wrap("recompute_all")(lambda x: (lambda h: (h, h.sin()))(x @ w))
        h, s = block(x)
        h.mul_(2)
        return (h + s).sum(), (x, w)

    plain_autograd_raises(program)
    torch.manual_seed(0)
    x, w = leaves()
    h0 = (x @ w).detach()
    # loss = sum(2 h0 + sin h0), so dloss/dh0 = 2 + cos h0
    expected = (x.detach().t() @ (2.0 + h0.cos()), (2.0 + h0.cos()) @ w.detach().t())
    ours = grads(program, sc.sac_region)
    torch.testing.assert_close(ours[1], expected[0])
    torch.testing.assert_close(ours[0], expected[1])


def test_saved_value_mutated_between_two_backwards_with_retain_graph_raises():
    x, w = leaves()
    # sin's backward reads y: the first backward reuses the live output, still unmodified
    y, s = sc.sac_region("recompute_all")(lambda x: (lambda y: (y, y.sin()))(x @ w))(x)
    s.sum().backward(retain_graph=True)
    y.mul_(2)
    with pytest.raises(CheckpointError, match="modified in place after the region returned it"):
        s.sum().backward()


# -- 3. list mutation (foreach ops) --------------------------------------------------------

def test_foreach_add_on_a_region_input_an_earlier_op_read_is_a_mutation():
    def program(wrap):
        x, w = leaves()

        @wrap("recompute_all")
        def block(h):
            a = h * 2.0               # reads h, saves nothing
            torch._foreach_add_([h], 1.0)
            return (a * h) @ w        # reads the new h

        return block(x * 1.0).sin().sum(), (x, w)

    assert_same_gradients(program)


@pytest.mark.parametrize("policy", [policies.save_all, policies.save_matmuls])
def test_foreach_mul_on_a_value_the_policy_saved(policy):
    def program(wrap):
        x, w = leaves()

        @wrap(policy)
        def block(x):
            a = x @ w
            b = a * 3.0          # reads a, saves nothing
            torch._foreach_mul_([a, b], [2.0, 3.0])
            return (b * a).cos()

        return block(x).sum(), (x, w)

    if policy is policies.save_all:  # PREFER_SAVE: the mutated value is recomputed instead
        assert_same_gradients(program)
    else:  # MUST_SAVE: the region's own mutation of a saved value, as for x.mul_(2)
        grads(program, identity)
        with pytest.raises(CheckpointError, match=r"saved output of aten\.mm\.default .* was "
                           r"mutated in place by aten\._foreach_mul_\.ScalarList"):
            grads(program, sc.sac_region)


def test_foreach_mul_on_a_saved_value_with_allow_cache_entry_mutation_keeps_a_copy():
    def program(wrap):
        x, w = leaves()

        def block(x):
            a = x @ w
            b = a * 3.0
            torch._foreach_mul_([a], 2.0)
            return (b * a).cos()

        if wrap is sc.sac_region:
            block = sc.sac_region(policies.save_matmuls, allow_cache_entry_mutation=True)(block)
        return block(x).sum(), (x, w)

    assert_same_gradients(program)


def test_out_of_place_foreach_ops_are_recorded_and_replayed():
    def program(wrap):
        x, w = leaves()

        @wrap("recompute_all")
        def block(x):
            a, b = torch._foreach_mul([x, x @ w], 2.0)
            return (a.sin() * b.cos())

        return block(x).sum(), (x, w)

    assert_same_gradients(program)


# -- 4. tensors autograd saved that the region did not produce ----------------------------

def test_parameter_updated_before_backward_raises_like_plain_autograd():
    def program(wrap):
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8, requires_grad=True)
        y = wrap("recompute_all")(lin)(x).sin().sum()
        with torch.no_grad():
            lin.weight.add_(1)  # optimizer.step() before backward
        return y, (x,)

    plain_autograd_raises(program)
    with pytest.raises(CheckpointError, match=r"in region 'Linear' needs a \(8, 8\) float32 "
                       r"tensor.*modified in place since.*optimizer\.step"):
        grads(program, sc.sac_region)


def test_buffer_updated_in_place_inside_the_region_after_it_was_saved_raises():
    def program(wrap):
        x, _ = leaves()
        buf = torch.randn(8)

        @wrap("recompute_all")
        def block(x):
            y = x * buf          # autograd saves buf
            buf.add_(1)
            return y.sin()

        return block(x).sum(), (x,)

    plain_autograd_raises(program)
    with pytest.raises(CheckpointError, match=r"region '[^']*block' needs a \(8,\) float32 tensor"):
        grads(program, sc.sac_region)


def test_updates_after_backward_are_free():
    """The check is on what backward reads: updating after backward, as a training loop
    does, never raises, and takes the steps training without checkpointing takes."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 8)
    lin = copy.deepcopy(plain)
    start = plain.weight.detach().clone()
    block = sc.sac_region(policies.save_matmuls)(lin)
    x = torch.randn(4, 8)
    weights = []
    for module, call in ((plain, plain), (lin, block)):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(3):
            h = x * 1.0
            h = h + call(h).relu()
            h.sum().backward()
            opt.step()
            opt.zero_grad()
        weights.append(module.weight.detach().clone())
    assert not torch.equal(weights[1], start)  # the steps were taken
    assert torch.equal(weights[0], weights[1])  # 3 steps, bit for bit


# -- 5. hidden mutation ---------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["recompute_all", "save_all", "save_matmuls"])
def test_rrelu_in_training_fills_its_noise_and_replays_it(policy):
    def program(wrap):
        x, w = leaves()
        block = wrap(policy)(lambda x: F.rrelu(x @ w, training=True).sin())
        return block(x).sum(), (x, w)

    assert_same_gradients(program)


# -- the same family: state backward runs under --------------------------------------------

def test_inference_mode_block_inside_a_region():
    def program(wrap):
        x, w = leaves()

        @wrap("recompute_all")
        def block(x):
            with torch.inference_mode():
                scale = torch.ones(8) * 2.0
            return ((x * scale.clone()) @ w).sin()

        return block(x).sum(), (x, w)

    assert_same_gradients(program)


def test_lstm_on_cpu_replays_its_workspace():
    def program(wrap):
        lstm = torch.nn.LSTM(8, 8)
        x = torch.randn(3, 2, 8, requires_grad=True)
        out, _ = wrap("recompute_all")(lstm)(x)
        return out.sum(), (x, lstm.weight_ih_l0, lstm.weight_hh_l0)

    assert_same_gradients(program)


def test_factory_ops_replay_under_the_default_dtype_the_forward_saw():
    def program(wrap):
        x, w = leaves()
        block = wrap("recompute_all")(lambda x: ((x * torch.ones(8)) @ w).sin())
        return block(x).sum(), (x, w)

    torch.manual_seed(0)
    ref = grads(program, identity)
    torch.manual_seed(0)
    loss, (x, w) = program(sc.sac_region)
    torch.set_default_dtype(torch.float64)
    try:
        loss.backward()
    finally:
        torch.set_default_dtype(torch.float32)
    torch.testing.assert_close(x.grad, ref[0], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, ref[1], rtol=0, atol=0)


def test_inner_region_allow_cache_entry_mutation_applies_to_what_it_saves():
    def program(wrap):
        x, w = leaves()

        def inner(x):
            a = x @ w
            b = a * 3.0
            a.mul_(2)
            return b * a

        if wrap is sc.sac_region:
            inner = sc.sac_region(policies.save_matmuls, allow_cache_entry_mutation=True)(inner)
            outer = sc.sac_region("recompute_all", name="Outer")(lambda x: inner(x).cos())
        else:
            outer = lambda x: inner(x).cos()  # noqa: E731
        return outer(x).sum(), (x, w)

    assert_same_gradients(program)


def test_mutation_error_names_the_inner_region_whose_flag_would_allow_it():
    x, w = leaves()

    @sc.sac_region(policies.save_matmuls, name="Inner")
    def inner(x):
        a = x @ w
        b = a.sin()
        a.mul_(2)
        return b * a

    outer = sc.sac_region("recompute_all", name="Outer")(lambda x: inner(x).cos())
    with pytest.raises(CheckpointError, match=r"aten\.mm\.default \(op #0 of region 'Inner'\)"):
        outer(x).sum().backward()


def test_policy_saving_a_tag_mutated_later_in_the_region_is_recomputed_when_prefer():
    def program(wrap):
        x, w = leaves()

        @wrap("recompute_all")
        def block(x):
            a = x @ w
            if wrap is sc.sac_region:
                sc.tag(a, CheckpointPolicy.PREFER_SAVE)
            b = a * 3.0
            a.add_(1)
            return (b * a).sum()

        return block(x), (x, w)

    assert_same_gradients(program)
