"""The memory rules every part shares (sac_compile.tensor_memory): one storage key, one
view rule."""
import torch
import torch.nn as nn

from sac_compile.tensor_memory import is_view_op, param_storages, storage_key, storage_nbytes

aten = torch.ops.aten


def test_storage_key_is_shared_exactly_by_tensors_sharing_memory():
    x = torch.randn(4, 4)
    assert storage_key(x) == storage_key(x.t()) == storage_key(x[1:]) == storage_key(x.detach())
    assert storage_key(x) != storage_key(x.clone())
    # two empty tensors: no memory, data pointer 0 for both, and still two storages
    a, b = torch.empty(0), torch.empty(0)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0
    assert storage_key(a) != storage_key(b)
    assert storage_nbytes(x[1:]) == 64  # a view holds its whole base


def test_param_storages_are_the_parameters_and_buffers():
    m = nn.BatchNorm1d(3)
    keys = param_storages(m)
    assert len(keys) == 5  # weight, bias, running_mean, running_var, num_batches_tracked
    assert storage_key(m.weight[:1]) in keys and storage_key(torch.ones(3)) not in keys


def test_is_view_op_on_view_in_place_and_new_memory_ops():
    views = [aten.view.default, aten.t.default, aten.split.Tensor, aten.detach.default,
             aten.alias.default, aten.expand.default, aten.select.int]
    not_views = [aten.mm.default, aten.add_.Tensor, aten.copy_.default, aten.clone.default,
                 aten.add.out, aten.relu.default]
    assert [op for op in views if not is_view_op(op)] == []
    assert [op for op in not_views if is_view_op(op)] == []
    assert not is_view_op(aten.view)  # a packet, not an op
    assert not is_view_op(torch.Tensor.view)
