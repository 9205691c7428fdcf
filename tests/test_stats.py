"""Tests of torchdebug.stats: analyze_tensor / TensorStats and the fused norm helpers."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchdebug.stats import TensorStats, analyze_tensor, foreach_norms, nonfinite_count, total_norm

NAN, INF = math.nan, math.inf


def cuda(test):  # type: ignore[no-untyped-def]
    """A CUDA test: marked ``gpu`` (``pytest -m gpu``), skipped without a device."""
    return pytest.mark.gpu(
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test)
    )


class CountScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: what ``.item()``, ``float(t)`` and ``bool(t)`` dispatch to."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------- analyze_tensor: exact cases


def test_float_with_nan_and_inf_counts_and_stats_over_finite_values():
    s = analyze_tensor(torch.tensor([1.0, NAN, 3.0, INF, -INF, 0.0]), "x")
    assert (s.nan_count, s.posinf_count, s.neginf_count) == (1, 1, 1)
    assert s.has_nan and s.has_inf and s.nonfinite_count == 3
    # finite values 1, 3, 0: mean 4/3; squared deviations 1/9 + 25/9 + 16/9 = 42/9, /(3-1) -> 7/3
    assert (s.min, s.max, s.abs_max, s.abs_min) == (0.0, 3.0, 3.0, 1.0)
    assert s.mean == pytest.approx(4 / 3, rel=1e-6)
    assert s.std == pytest.approx(math.sqrt(7 / 3), rel=1e-6)
    assert s.zero_fraction == pytest.approx(1 / 3)
    assert (s.shape, s.dtype, s.device, s.numel, s.bytes) == ((6,), "float32", "cpu", 6, 24)
    assert str(s) == "x: tensor[6] f32 cpu x∈[0, 3] μ=1.33 σ=1.53 NaN!×1 +Inf!×1 -Inf!×1"


@pytest.mark.parametrize(
    ("values", "lo", "hi"),
    [
        ([2.0, NAN, 5.0], 2.0, 5.0),  # all finite > 0: the 0 put in for NaN must not be the min
        ([-2.0, INF, -5.0], -5.0, -2.0),  # all finite < 0: nor the max
        ([0.0, NAN, 5.0], 0.0, 5.0),  # a real zero is the min
        ([-3.0, -INF, 0.0], -3.0, 0.0),
    ],
    ids=["positive", "negative", "real-zero-min", "real-zero-max"],
)
def test_range_ignores_the_zeros_put_in_for_nonfinite_values(values, lo, hi):
    s = analyze_tensor(torch.tensor(values))
    assert (s.min, s.max) == (lo, hi)


def test_matches_torch_reference_on_random_data():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 33, generator=g) * 3 + 1
    s = analyze_tensor(t)
    ref = t.double()
    assert s.min == ref.min().item() and s.max == ref.max().item()
    assert s.mean == pytest.approx(ref.mean().item(), rel=1e-5)
    assert s.std == pytest.approx(ref.std().item(), rel=1e-5)
    assert s.abs_max == ref.abs().max().item()
    assert s.abs_min == ref.abs().min().item()  # no exact zero in randn data
    assert s.zero_fraction == 0.0 and s.nonfinite_count == 0


def test_empty_tensor():
    s = analyze_tensor(torch.empty(0, 3))
    assert (s.shape, s.numel, s.bytes) == ((0, 3), 0, 0)
    assert s.min is s.max is s.mean is s.std is s.abs_max is s.abs_min is s.zero_fraction is None
    assert str(s) == "tensor[0, 3] f32 cpu empty"


def test_zero_dim_tensor():
    s = analyze_tensor(torch.tensor(2.5))
    assert s.shape == () and s.numel == 1
    assert (s.min, s.max, s.mean, s.abs_min) == (2.5, 2.5, 2.5, 2.5)
    assert s.std is None  # one value: no sample standard deviation
    assert str(s) == "tensor[] f32 cpu x=2.5"


def test_integer_tensor_reports_exact_ints_and_no_nan_counts():
    s = analyze_tensor(torch.arange(10))
    assert (s.min, s.max, s.abs_max, s.abs_min) == (0, 9, 9, 1)
    assert all(type(v) is int for v in (s.min, s.max, s.abs_max, s.abs_min))
    # mean 4.5; sum of (i - 4.5)^2 for i in 0..9 = 82.5; / 9 -> std sqrt(9.1667) = 3.0277
    assert s.mean == 4.5 and s.std == pytest.approx(math.sqrt(82.5 / 9))
    assert s.zero_fraction == 0.1 and s.nonfinite_count == 0
    assert str(s) == "tensor[10] i64 cpu x∈[0, 9] μ=4.5 σ=3.03"


def test_large_int64_values_are_exact_below_2_pow_53():
    big = 2**52 + 1  # needs 53 bits: float32 would round it
    s = analyze_tensor(torch.tensor([-big, 7], dtype=torch.int64))
    assert (s.min, s.max, s.abs_max, s.abs_min) == (-big, 7, big, 7)


def test_bool_tensor():
    s = analyze_tensor(torch.tensor([True, False, True, True]))
    # values 1, 0, 1, 1: mean 0.75; deviations .25, -.75, .25, .25 -> squares sum .75, / 3 -> .25
    assert (s.min, s.max, s.mean, s.std) == (0, 1, 0.75, 0.5)
    assert s.zero_fraction == 0.25 and s.nonfinite_count == 0 and s.bytes == 4
    assert str(s) == "tensor[4] bool cpu x∈[0, 1] μ=0.75 σ=0.5"


def test_complex_tensor_uses_magnitudes_and_nan_in_either_part():
    t = torch.tensor([3 + 4j, complex(NAN, 1), complex(INF, 0), 0j, complex(INF, NAN)], dtype=torch.complex64)
    s = analyze_tensor(t)
    # NaN real or imag part -> NaN (also inf+nan·j, whose |.| torch reports as inf); inf+0j -> +Inf
    assert (s.nan_count, s.posinf_count, s.neginf_count) == (2, 1, 0)
    # finite magnitudes 5 and 0: mean 2.5, std sqrt((2.5^2 + 2.5^2) / 1) = 3.5355
    assert (s.min, s.max, s.mean, s.abs_min) == (0.0, 5.0, 2.5, 5.0)
    assert s.std == pytest.approx(math.sqrt(12.5))
    assert str(s) == "tensor[5] c64 cpu |x|∈[0, 5] μ=2.5 σ=3.54 NaN!×2 +Inf!×1"


def test_float16_accumulates_in_float32_without_overflow():
    # 60000 is exact in fp16 (spacing 32 above 32768); its square or the sum overflow fp16 (max 65504).
    t = torch.tensor([60000.0, 60000.0, -60000.0, 60000.0], dtype=torch.float16)
    s = analyze_tensor(t)
    # mean 30000; deviations 3e4, 3e4, -9e4, 3e4 -> squares 2.7e9 + 8.1e9 = 1.08e10, / 3 -> 3.6e9
    assert s.mean == 30000.0
    assert s.std == pytest.approx(60000.0, rel=1e-6)  # sqrt(3.6e9) rounded in float32
    assert s.dtype == "float16" and s.bytes == 8
    assert str(s) == "tensor[4] f16 cpu x∈[-6e+04, 6e+04] μ=3e+04 σ=6e+04"


def test_huge_float_values_do_not_overflow_the_standard_deviation():
    t = torch.tensor([1e38, -1e38, 3e38]).to(torch.bfloat16)
    v = t.double()  # the values bf16 actually holds
    s = analyze_tensor(t)
    # x^2 ~ 1e76 overflows float32; the scaled two-pass computation must not
    assert s.mean == pytest.approx(v.mean().item(), rel=1e-6)
    assert s.std == pytest.approx(v.std().item(), rel=1e-6)
    assert math.isfinite(s.std)


def test_float8_is_read_through_float32():
    t = torch.tensor([1.0, -2.0, INF, NAN]).to(torch.float8_e5m2)  # e5m2 holds Inf and NaN
    s = analyze_tensor(t)
    # finite 1 and -2: mean -0.5, deviations +-1.5 -> std sqrt(4.5 / 1) = 2.121
    assert (s.min, s.max, s.mean, s.nan_count, s.posinf_count, s.bytes) == (-2.0, 1.0, -0.5, 1, 1, 4)
    assert str(s) == "tensor[4] f8e5m2 cpu x∈[-2, 1] μ=-0.5 σ=2.12 NaN!×1 +Inf!×1"
    assert nonfinite_count(t).item() == 2
    assert foreach_norms([torch.tensor([3.0, 4.0]).to(torch.float8_e4m3fn)]).tolist() == [5.0]


def test_uint8():
    s = analyze_tensor(torch.tensor([1, 2, 3], dtype=torch.uint8))
    assert (s.min, s.max, s.mean, s.bytes) == (1, 2 + 1, 2.0, 3)
    assert s.std == pytest.approx(1.0, rel=1e-15)  # sqrt((1 + 0 + 1) / 2); the scaled norm may round by 1 ulp
    assert str(s) == "tensor[3] u8 cpu x∈[1, 3] μ=2 σ=1"


def test_float64_keeps_float64_precision():
    t = torch.tensor([1.0, 1.0 + 2**-40], dtype=torch.float64)
    s = analyze_tensor(t)
    assert s.max - s.min == 2**-40  # float32 would give 0
    assert s.mean == pytest.approx(1.0 + 2**-41, abs=1e-15)


def test_non_contiguous_view():
    t = torch.arange(12.0).reshape(3, 4)[:, ::2].t()  # values 0, 2, 4, 6, 8, 10
    assert not t.is_contiguous()
    s = analyze_tensor(t)
    # mean 5; squared deviations 25+9+1+1+9+25 = 70, / 5 = 14 -> std sqrt(14) = 3.742
    assert (s.shape, s.min, s.max, s.mean) == ((2, 3), 0.0, 10.0, 5.0)
    assert s.std == pytest.approx(math.sqrt(14))
    assert str(s) == "tensor[2, 3] f32 cpu x∈[0, 10] μ=5 σ=3.74"


def test_meta_tensor_is_shape_only():
    s = analyze_tensor(torch.empty(2, 3, device="meta"))
    assert (s.shape, s.device, s.numel, s.bytes) == ((2, 3), "meta", 6, 24)
    assert s.min is None and s.mean is None and s.nonfinite_count == 0
    assert str(s) == "tensor[2, 3] f32 meta"


def test_all_nonfinite_gives_none_statistics():
    s = analyze_tensor(torch.tensor([NAN, INF, NAN]))
    assert s.min is s.max is s.mean is s.std is s.abs_max is s.abs_min is s.zero_fraction is None
    assert str(s) == "tensor[3] f32 cpu NaN!×2 +Inf!×1"


def test_all_zeros():
    s = analyze_tensor(torch.zeros(2, 3))
    assert (s.min, s.max, s.mean, s.std, s.zero_fraction) == (0.0, 0.0, 0.0, 0.0, 1.0)
    assert s.abs_min is None  # no nonzero magnitude
    assert str(s) == "tensor[2, 3] f32 cpu all zeros"


def test_large_numbers_print_compactly():
    s = analyze_tensor(torch.tensor([-31000.0, 62000.0]))
    # mean 15500; std |a - b| / sqrt(2) = 93000 / 1.41421 = 65761
    assert str(s) == "tensor[2] f32 cpu x∈[-3.1e+04, 6.2e+04] μ=1.55e+04 σ=6.58e+04"


def test_tensor_that_requires_grad_is_read_without_touching_the_graph():
    p = torch.tensor([1.0, 2.0], requires_grad=True)
    y = p * 2
    version = y._version
    s = analyze_tensor(y, "y")
    assert s.requires_grad and s.grad_fn == "MulBackward0"
    assert str(s) == "y: tensor[2] f32 cpu x∈[2, 4] μ=3 σ=1.41 grad_fn=MulBackward0"
    assert y._version == version  # nothing written in place
    y.sum().backward()
    assert p.grad.tolist() == [2.0, 2.0]
    assert str(analyze_tensor(p)) == "tensor[2] f32 cpu x∈[1, 2] μ=1.5 σ=0.707 requires_grad"


def test_sparse_tensor_is_analysed_as_dense():
    t = torch.tensor([[0.0, 2.0], [0.0, -4.0]]).to_sparse()
    s = analyze_tensor(t)
    assert (s.min, s.max, s.zero_fraction, s.numel) == (-4.0, 2.0, 0.5, 4)


def test_analyze_tensor_rejects_non_tensors():
    with pytest.raises(TypeError, match=r"expects a torch\.Tensor, got list"):
        analyze_tensor([1.0, 2.0])  # type: ignore[arg-type]


def test_analyze_tensor_reads_no_scalar_one_by_one():
    with CountScalarReads() as counter:
        analyze_tensor(torch.tensor([1.0, NAN, 3.0]))
    assert counter.reads == 0  # everything crosses in the single .tolist()


CASES = {
    "float-nan-inf": torch.tensor([1.0, NAN, INF, -INF]),
    "empty": torch.empty(0),
    "0-dim": torch.tensor(-1.5),
    "int": torch.arange(4, dtype=torch.int32),
    "bool": torch.tensor([True, False]),
    "complex": torch.tensor([1 + 1j, complex(NAN, 0)]),
    "bf16": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
    "meta": torch.empty(3, device="meta"),
    "all-nan": torch.full((2,), NAN),
}


@pytest.mark.parametrize("t", CASES.values(), ids=CASES.keys())
def test_to_dict_is_strict_json(t):
    d = analyze_tensor(t, "t").to_dict()
    text = json.dumps(d, allow_nan=False)  # raises on NaN/Inf floats
    assert json.loads(text) == d
    assert isinstance(d["shape"], list) and d["has_nan"] == (analyze_tensor(t).nan_count > 0)


def test_to_dict_maps_hand_made_nonfinite_floats_to_none():
    s = TensorStats(name=None, shape=(1,), dtype="float32", device="cpu", numel=1, bytes=4, min=NAN, std=INF)
    d = s.to_dict()
    assert d["min"] is None and d["std"] is None
    json.dumps(d, allow_nan=False)


@cuda
def test_cuda_tensor_matches_cpu_and_syncs_once():
    t = torch.tensor([1.0, NAN, 3.0, INF, -INF, 0.0])
    on_cpu = analyze_tensor(t)
    previous = torch.cuda.get_sync_debug_mode()
    x = t.cuda()
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on_gpu = analyze_tensor(x)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1
    assert on_gpu.device == "cuda:0"
    gpu, cpu = on_gpu.to_dict() | {"device": "cpu"}, on_cpu.to_dict()
    # the same numbers, but the device's float32 reduction order may differ in the last bit (seen on
    # an H100: std 1.5275254 on CPU, 1.5275252 on CUDA)
    close = {k for k, v in cpu.items() if isinstance(v, float) and math.isfinite(v) and k in ("mean", "std")}
    assert {k: v for k, v in gpu.items() if k not in close} == {
        k: v for k, v in cpu.items() if k not in close
    }
    assert all(gpu[k] == pytest.approx(cpu[k], rel=1e-6) for k in close) and "std" in close


# ---------------------------------------------------------------- fused norms


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randn(7, 5, generator=g),
        torch.randn(9, generator=g).to(torch.float16),
        torch.randn(4, 4, generator=g).to(torch.bfloat16),
        torch.randn(6, 3, generator=g, dtype=torch.float64),
        torch.randn(6, 8, generator=g)[:, ::3],  # non-contiguous
        torch.randn(3, 2, generator=g),
    ]


def test_foreach_norms_hand_computed():
    a, b = torch.tensor([3.0, 4.0]), torch.ones(4)
    assert foreach_norms([a, b]).tolist() == [5.0, 2.0]  # sqrt(9+16); sqrt(4)
    assert foreach_norms([a, b], 1).tolist() == [7.0, 4.0]
    assert foreach_norms([a, b], "inf").tolist() == [4.0, 1.0]
    # totals: sqrt(5^2 + 2^2) = sqrt(29); 7 + 4; max(4, 1)
    assert total_norm(foreach_norms([a, b])).item() == pytest.approx(math.sqrt(29))
    assert total_norm(foreach_norms([a, b], 1), 1).item() == 11.0
    assert total_norm(foreach_norms([a, b], INF), INF).item() == 4.0


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, 0.5, 0.0, INF, -INF], ids=lambda p: f"p={p}")
def test_foreach_norms_match_vector_norm(p):
    ts = _tensors()
    norms = foreach_norms(ts, p)
    assert norms.dtype == torch.float32 and norms.shape == (len(ts),)
    ref = torch.stack([torch.linalg.vector_norm(t.double(), p) for t in ts]).float()
    torch.testing.assert_close(norms, ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("p", [2.0, 1.0, INF], ids=lambda p: f"p={p}")
def test_total_norm_matches_clip_grad_norm(p):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    model(torch.randn(4, 8)).pow(2).sum().backward()
    grads = [q.grad.clone() for q in model.parameters()]
    ours = total_norm(foreach_norms(grads, p), p)
    theirs = nn.utils.clip_grad_norm_(model.parameters(), max_norm=INF, norm_type=p)
    assert ours.shape == ()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("p", [2.0, INF], ids=lambda p: f"p={p}")
@pytest.mark.parametrize("bad", [NAN, INF], ids=["nan", "inf"])
def test_nonfinite_values_propagate_like_clip_grad_norm(p, bad):
    grads = [torch.tensor([1.0, bad, 2.0]), torch.tensor([3.0])]
    ours = total_norm(foreach_norms(grads, p), p)
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for q, g in zip(params, grads):
        q.grad = g.clone()
    theirs = nn.utils.clip_grad_norm_(params, max_norm=INF, norm_type=p)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    assert not math.isfinite(ours.item())


def test_float16_norm_accumulates_in_float32():
    t = torch.full((1000,), 300.0, dtype=torch.float16)  # 300^2 = 90000 > fp16 max 65504
    # 300 * sqrt(1000) = 9486.83
    assert foreach_norms([t]).item() == pytest.approx(300 * math.sqrt(1000), rel=1e-6)


def test_fallback_types_integer_complex_sparse():
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 1, 4])).sum().backward()  # uncoalesced: row 1 listed twice
    grad = emb.weight.grad
    assert grad.is_sparse
    ts = [torch.tensor([3, 4]), torch.tensor([3 + 4j, 0j]), grad]
    # |3|,|4| -> 2-norm 5, max 4, min 3; |3+4j|,|0| -> 2-norm 5, max 5, min 0
    expected = {2.0: [5.0, 5.0], INF: [4.0, 5.0], -INF: [3.0, 0.0]}
    for p, ref in expected.items():
        ref.append(torch.linalg.vector_norm(grad.to_dense(), p).item())  # -inf: 0 from untouched rows
        torch.testing.assert_close(foreach_norms(ts, p), torch.tensor(ref))


def test_empty_inputs():
    assert foreach_norms([]).shape == (0,)
    assert total_norm(foreach_norms([])).item() == 0.0  # as clip_grad_norm_ with no gradients
    assert total_norm([]).item() == 0.0
    # an empty tensor has norm 0 for every p, where torch raises for the inf norm
    assert foreach_norms([torch.empty(0), torch.tensor([-2.0])], INF).tolist() == [0.0, 2.0]


def test_total_norm_accepts_a_sequence_of_scalars():
    assert total_norm([torch.tensor(3.0), torch.tensor(4.0)]).item() == 5.0


@pytest.mark.parametrize("p", ["fro", True, NAN, None], ids=["fro", "bool", "nan", "none"])
def test_bad_norm_type_raises(p):
    with pytest.raises(ValueError, match="norm_type"):
        foreach_norms([torch.ones(2)], p)  # type: ignore[arg-type]


def test_bad_inputs_raise():
    with pytest.raises(TypeError, match="item 1 is a list"):
        foreach_norms([torch.ones(2), [1.0]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="must be 1-D"):
        total_norm(torch.ones(2, 2))
    with pytest.raises(TypeError, match="got float"):
        nonfinite_count(1.0)  # type: ignore[arg-type]


def test_nonfinite_count():
    n = nonfinite_count(torch.tensor([1.0, NAN, INF, -INF, 0.0]))
    assert n.dtype == torch.int64 and n.shape == () and n.item() == 3
    assert nonfinite_count(torch.tensor([NAN, 1.0], dtype=torch.bfloat16)).item() == 1
    assert nonfinite_count(torch.arange(5)).item() == 0
    assert nonfinite_count(torch.tensor([complex(NAN, 0), complex(1, INF), 1 + 1j])).item() == 2
    t = torch.tensor([[NAN, 1.0], [2.0, INF]]).t()
    assert not t.is_contiguous() and nonfinite_count(t).item() == 2
    assert nonfinite_count(torch.tensor([0.0, NAN, 0.0]).to_sparse()).item() == 1


def test_fused_helpers_read_no_scalar():
    ts = _tensors()
    with CountScalarReads() as counter:
        total_norm(foreach_norms(ts, 2.0), 2.0)
        total_norm(foreach_norms(ts, "inf"), "inf")
        nonfinite_count(ts[0])
    assert counter.reads == 0


@cuda
def test_fused_helpers_do_not_sync_on_cuda():
    ts = [t.cuda() for t in _tensors()]
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")  # any host sync raises
        norms = foreach_norms(ts)
        total = total_norm(norms)
        count = nonfinite_count(ts[0])
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    ref = torch.stack([torch.linalg.vector_norm(t.double()) for t in ts]).float()
    torch.testing.assert_close(norms.cpu(), ref.cpu(), rtol=1e-5, atol=0)
    assert total.device.type == "cuda" and count.item() == 0


def test_norms_of_parameters_build_no_graph():
    params = [
        torch.ones(3, requires_grad=True),  # foreach path
        torch.ones(2, dtype=torch.complex64, requires_grad=True),  # fallback path
    ]
    norms = foreach_norms(params)
    assert not norms.requires_grad and norms.grad_fn is None
    torch.testing.assert_close(norms, torch.tensor([math.sqrt(3), math.sqrt(2)]))
