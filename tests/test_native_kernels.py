"""verispec's own bf16 matmul (kernels/bf16_gemm.c): it computes x @ W.T + b, a row's bits depend
on nothing but that row (not the row count, its position, nor the thread count), and where it
cannot be built the reason is given and prepacked weights fall back to oneDNN."""

from __future__ import annotations

import ctypes

import pytest
import torch

from verispec import kernels
from verispec.kernels import bf16_gemm, pack_bf16, run_bf16_gemm
from verispec.models.prepack import PrepackedWeight

needs_kernel = pytest.mark.skipif(bf16_gemm() is None, reason=f"native bf16 kernel unavailable: {kernels.why_not()}")


def _rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


@needs_kernel
@pytest.mark.parametrize("N,K", [(1, 2), (17, 30), (9, 63), (128, 64), (200, 640), (1536, 640), (640, 2048)])
def test_kernel_computes_x_times_w_transposed_plus_bias(N, K):
    """Against fp32 matmul of the same bf16 values, to bf16 rounding: N not a multiple of the
    64-row group (padding rows must not leak into the output), K not a multiple of 32, and an odd
    K (the weight and the input padded with a zero column)."""
    w, b = _rand(N, K, seed=0, scale=0.05), torch.randn(N, generator=torch.Generator().manual_seed(1))
    packed = pack_bf16(w)
    for M in (1, 3, 70):
        x = _rand(M, K, seed=M)
        ref = x.float() @ w.float().t()
        for bias in (None, b):
            want = ref if bias is None else ref + bias
            got = run_bf16_gemm(bf16_gemm(), x, packed, bias, N)
            assert got.shape == (M, N) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item() + 1e-6)


@needs_kernel
def test_a_rows_bits_do_not_depend_on_the_call():
    """Each of 70 rows alone, among 1-70 others at any position, and on one thread or two: the same bits."""
    N, K = 640, 2048
    packed = pack_bf16(_rand(N, K, seed=2, scale=0.05))
    X = _rand(70, K, seed=3)
    fn = bf16_gemm()
    alone = torch.cat([run_bf16_gemm(fn, X[i : i + 1], packed, None, N) for i in range(len(X))])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for M in (2, 3, 5, 16, 17, 64, 70):
                assert torch.equal(run_bf16_gemm(fn, X[:M].contiguous(), packed, None, N), alone[:M]), (t, M)
                assert torch.equal(run_bf16_gemm(fn, X[70 - M :].contiguous(), packed, None, N), alone[70 - M :]), (t, M)
    finally:
        torch.set_num_threads(threads)


def _variants():
    """This CPU's library, and the narrower instruction sets it can also run (built with -mno-...)."""
    if bf16_gemm() is None:
        return []
    found = {}
    for flags in ((), ("-mno-avx512bf16",), ("-mno-avx512f",)):
        try:
            lib = kernels._compile_and_open(flags)
        except RuntimeError:  # a compiler that does not know the flag: that variant is not checked
            if not flags:
                raise
            continue
        lib.verispec_kernel_isa.restype = ctypes.c_char_p
        found.setdefault(lib.verispec_kernel_isa().decode(), lib)
    return list(found.items())


@needs_kernel
def test_every_instruction_set_computes_the_same_product_invariantly():
    """AVX512-BF16, AVX512 and AVX2 builds (those this CPU runs): each against fp32 to bf16
    rounding, for shapes that leave partial groups and tiles, and each row's bits the same alone,
    among others and on one thread or two."""
    variants = _variants()
    assert kernels.isa() == variants[0][0]
    threads = torch.get_num_threads()
    for isa, lib in variants:
        fn = lib.verispec_bf16_gemm
        fn.restype, fn.argtypes = None, [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        for N, K in ((200, 640), (9, 30), (640, 2048)):
            w, b = _rand(N, K, seed=N, scale=0.05), torch.randn(N, generator=torch.Generator().manual_seed(K))
            packed = pack_bf16(w)
            X = _rand(11, K, seed=K)
            want = X.float() @ w.float().t() + b
            alone = torch.cat([run_bf16_gemm(fn, X[i : i + 1], packed, b, N) for i in range(len(X))])
            torch.testing.assert_close(alone.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item(), msg=isa)
            try:
                for t in (1, 2):
                    torch.set_num_threads(t)
                    for M in (2, 3, 4, 5, 8, 11):
                        assert torch.equal(run_bf16_gemm(fn, X[:M].contiguous(), packed, b, N), alone[:M]), (isa, N, K, t, M)
            finally:
                torch.set_num_threads(threads)


@needs_kernel
def test_prepacked_weights_use_it_and_refuse_other_inputs():
    pw = PrepackedWeight(_rand(96, 64, seed=4))
    assert pw.native is not None and pw.packed.shape == (2, 32, 64, 2)
    with pytest.raises(TypeError, match="multiplies bf16 inputs, not torch.float32"):
        pw.mm(torch.zeros(1, 64))
    odd = PrepackedWeight(_rand(96, 63, seed=5))  # odd K: padded with a zero column, as the input is
    assert odd.native is not None and odd.packed.shape == (2, 32, 64, 2)


def test_unavailable_kernel_says_why_and_prepacking_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernels, "_WHY_NOT", [])
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("VERISPEC_NATIVE", "1")
    assert bf16_gemm() is None
    assert kernels.why_not() is not None
    if kernels._cpu_flag("avx512_bf16"):
        assert "no C compiler" in kernels.why_not()
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setenv("VERISPEC_NATIVE", "0")
    assert bf16_gemm() is None and kernels.why_not() == "VERISPEC_NATIVE=0"
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        w = _rand(96, 64, seed=6)
        x = _rand(3, 64, seed=7)
        pw = PrepackedWeight(w)
        assert pw.native is None
        torch.testing.assert_close(pw.mm(x, invariant=True).float(), x.float() @ w.float().t(), rtol=1e-2, atol=1e-2)


needs_norm = pytest.mark.skipif(kernels.rms_norm() is None, reason=f"native kernels unavailable: {kernels.why_not()}")


def _torch_norm(x, w, eps, gemma):
    import torch.nn.functional as F

    if gemma:
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + w.float(), eps).type_as(x)
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).type_as(x)


@needs_norm
@pytest.mark.parametrize("gemma", [True, False])
def test_native_rms_norm_is_torchs_up_to_the_sum_order(gemma):
    """Dense rows, a strided head split of a fused projection (read in place, as attention's q/k
    norms do), sizes that are not a multiple of 16, and the fused residual add: within one bf16
    rounding of torch's norm (only the fp32 sum of squares is ordered differently), and nearly
    always the same bits."""
    from verispec.models.layers import RMSNorm

    qkv = _rand(3, 5, 6 * 40, seed=8)
    cases = [_rand(2, 7, 640, seed=9), qkv[..., : 4 * 40].reshape(3, 5, 4, 40), qkv[..., 4 * 40 : 5 * 40].reshape(3, 5, 1, 40),
             _rand(1, 1, 24, seed=10)]
    for x in cases:
        norm = RMSNorm(x.shape[-1], 1e-6, gemma).bfloat16()
        with torch.no_grad():
            norm.weight.copy_(torch.randn(x.shape[-1]) * 0.3)
            got = norm(x)
            res = _rand(*x.shape, seed=11)
            got_res = norm(x, residual=res)
        want = _torch_norm(x, norm.weight, 1e-6, gemma)
        assert got.is_contiguous() and got.shape == x.shape
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-5)
        torch.testing.assert_close(got_res, res + want, rtol=8e-3, atol=1e-2)
        assert (got == want).float().mean() > 0.99


@needs_norm
def test_norm_follows_its_weight_and_trains_through_torch():
    """The cached fp32 scale is rebuilt when the weight changes; with gradients on, the norm is
    torch's (so the weight gets a gradient)."""
    from verispec.models.layers import RMSNorm

    norm = RMSNorm(64, 1e-6, gemma=True).bfloat16()
    x = _rand(2, 64, seed=12)
    with torch.no_grad():
        before = norm(x)
        norm.weight.add_(1.0)
        after = norm(x)
    torch.testing.assert_close(after, _torch_norm(x, norm.weight.detach(), 1e-6, True), rtol=8e-3, atol=1e-5)
    assert not torch.equal(before, after)
    norm(x).float().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0


@needs_norm
def test_norm_made_under_inference_mode_runs():
    """A model built inside `torch.inference_mode()` holds inference tensors, which have no version
    counter to key the cached scale by (CI caught the token-tree tests failing on that)."""
    from verispec.models.layers import RMSNorm

    x = _rand(3, 40, seed=13)
    with torch.inference_mode():
        norm = RMSNorm(40, 1e-6, gemma=False).bfloat16()
        norm.weight.mul_(0.5)
        got = norm(x)
    torch.testing.assert_close(got, _torch_norm(x, norm.weight, 1e-6, False), rtol=8e-3, atol=1e-5)


needs_attention = pytest.mark.skipif(kernels.attention() is None, reason=f"native kernels unavailable: {kernels.why_not()}")


@needs_attention
@pytest.mark.parametrize("heads,softcap", [((4, 1), None), ((2, 2), None), ((4, 2), 50.0)])
def test_native_attention_is_the_matmul_attention_with_each_row_alone(heads, softcap):
    """attention.c against the two-matmul path it replaces (`grouped_attention` with gradients on,
    which keeps torch's ops): within a bf16 rounding. Then a query row's bits alone = among 1-40
    queries, beside other sequences, over 1,024 keys or 1,536 (the cache's bucket after a verify
    window), with NaN in the cache past the mask, on one thread or two; a row with no visible key is
    zeros."""
    from verispec.models.layers import grouped_attention

    h, kvh = heads
    g = torch.Generator().manual_seed(14)
    B, T, Lk, hd = 3, 40, 1536, 64
    K = torch.randn(B, kvh, Lk, hd, generator=g).bfloat16()
    V = torch.randn(B, kvh, Lk, hd, generator=g).bfloat16()
    q = (torch.randn(B, h, T, hd, generator=g) / 2).bfloat16()
    visible = (torch.arange(Lk)[None, :] <= (900 + torch.arange(T))[:, None])[None, None].expand(B, 1, T, Lk)
    fn = kernels.attention()
    got = kernels.run_attention(fn, q, K, V, visible, 0.125, softcap)
    with torch.enable_grad():
        ref = grouped_attention(q.requires_grad_(), K, V, visible, 0.125, softcap).detach()
    q = q.detach()
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    Kn, Vn = K.clone(), V.clone()
    Kn[:, :, 1024:], Vn[:, :, 1024:] = float("nan"), float("nan")  # never visible below: must not be read
    alone = torch.cat([kernels.run_attention(fn, q[:1, :, i : i + 1], K[:1, :, :1024], V[:1, :, :1024],
                                             visible[:1, :, i : i + 1, :1024], 0.125, softcap) for i in range(T)], 2)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for n in (1, 2, 5, 6, 17, 40):
                many = kernels.run_attention(fn, q[:, :, :n], Kn, Vn, visible[:, :, :n], 0.125, softcap)
                assert torch.equal(many[:1], alone[:, :, :n]), (t, n)
    finally:
        torch.set_num_threads(threads)
    strided = torch.cat([K, K], -1)[..., :hd]  # a view whose rows are not dense in the cache's sense
    assert torch.equal(kernels.run_attention(fn, q, strided, V, visible, 0.125, softcap), got)
    none = torch.zeros(B, 1, T, Lk, dtype=torch.bool)
    assert torch.equal(kernels.run_attention(fn, q, K, V, none, 0.125, softcap), torch.zeros_like(q))
    # read in place at cache slots (a decode batch whose slots are not consecutive) = gathered first
    cache_k = torch.cat([torch.full_like(K[:1], float("nan")), K.flip(0)])  # slot 0 unused, batch b at slot B - b
    cache_v = torch.cat([torch.full_like(V[:1], float("nan")), V.flip(0)])
    slots = torch.arange(B, 0, -1)
    assert torch.equal(kernels.run_attention(fn, q, cache_k, cache_v, visible, 0.125, softcap, slots), got)
    with pytest.raises(ValueError, match="must index"):
        kernels.run_attention(fn, q, cache_k, cache_v, visible, 0.125, softcap, slots + 1)


@needs_attention
def test_native_attention_has_the_same_bits_on_every_instruction_set():
    """The AVX512 and AVX2 builds keep the same 16 partial sums and add them in the same tree, so
    they agree bit for bit (a head size that is not a multiple of 16 takes the plain-C loop)."""
    g = torch.Generator().manual_seed(15)
    for hd in (64, 40):
        q = torch.randn(2, 4, 5, hd, generator=g).bfloat16()
        K, V = (torch.randn(2, 2, 300, hd, generator=g).bfloat16() for _ in range(2))
        visible = (torch.arange(300)[None, :] <= (250 + torch.arange(5))[:, None])[None, None].expand(2, 1, 5, 300)
        outs = {}
        for isa, lib in _variants():
            fn = lib.verispec_attention_bf16
            fn.restype, fn.argtypes = None, kernels.attention().argtypes
            outs[isa] = kernels.run_attention(fn, q, K, V, visible, 0.2, None)
        first = next(iter(outs.values()))
        assert all(torch.equal(o, first) for o in outs.values()), (hd, list(outs))


needs_rope = pytest.mark.skipif(kernels.rope() is None, reason=f"native kernels unavailable: {kernels.why_not()}")


@needs_rope
def test_native_rope_is_torchs_rotate_bit_for_bit():
    """rope.c against `rotate` on the transposed head split, then made dense (what attention did
    before): the same bits, for a strided split of a fused projection, tables broadcast over the
    batch, and a head size whose halves are not a multiple of 16."""
    from verispec.models.layers import rope_heads, rotate, rope_cos_sin

    g = torch.Generator().manual_seed(16)
    for B, T, H, hd in ((1, 1, 4, 256), (3, 7, 2, 40), (2, 5, 1, 64)):
        fused = torch.randn(B, T, (H + 2) * hd, generator=g).bfloat16()
        x = fused[..., : H * hd].reshape(B, T, H, hd)  # a strided view, as Attention's q / k
        cos, sin = (t.bfloat16() for t in rope_cos_sin(1.0 / 10000 ** (torch.arange(0, hd, 2) / hd),
                                                       torch.arange(100, 100 + T)[None].expand(B, T)))
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, hd]
        want = rotate(x.transpose(1, 2), cos, sin).contiguous()
        got = rope_heads(x, cos, sin)
        assert got.is_contiguous() and torch.equal(got, want), (B, T, H, hd)
        one = cos[:1].expand(B, 1, T, hd), sin[:1].expand(B, 1, T, hd)
        assert torch.equal(rope_heads(x, *one), rotate(x.transpose(1, 2), *one).contiguous())


needs_int8 = pytest.mark.skipif(kernels.int8_gemm() is None, reason=f"native kernels unavailable: {kernels.why_not()}")


@needs_int8
@pytest.mark.parametrize("N,K", [(64, 640), (100, 48), (640, 2048)])
def test_native_int8_gemm_is_x_times_the_scaled_codes_with_each_row_alone(N, K):
    """int8_gemm.c: (x @ Q.T) * scale in fp32 then bf16, against the same product in fp64 (within a
    bf16 rounding); the packed codes unpack to the codes; a row's bits are the same among 1-70 rows
    at any position and on one or two threads; and the AVX512 and AVX2 builds agree bit for bit."""
    g = torch.Generator().manual_seed(17)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = (torch.rand(N, generator=g) / 100 + 1e-3).bfloat16()
    x = torch.randn(70, K, generator=g).bfloat16()
    packed = kernels.pack_int8(q)
    assert torch.equal(kernels.unpack_int8(packed, N), q)
    fn = kernels.int8_gemm()
    got = kernels.run_int8_gemm(fn, x, packed, scale, N)
    ref = (x.double() @ q.double().T) * scale.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 3, 5, 64, 70):
                for start in (0, 70 - m):
                    part = kernels.run_int8_gemm(fn, x[start : start + m].contiguous(), packed, scale, N)
                    assert torch.equal(part, got[start : start + m]), (t, m, start)
    finally:
        torch.set_num_threads(threads)
    outs = {}
    for isa, lib in _variants():
        f = lib.verispec_int8_gemm
        f.restype, f.argtypes = None, fn.argtypes
        outs[isa] = kernels.run_int8_gemm(f, x[:7].contiguous(), packed, scale, N)
    assert all(torch.equal(o, got[:7]) for o in outs.values()), list(outs)


@needs_int8
def test_int8_weights_run_on_the_native_kernel_and_dequantize_to_what_it_computes():
    from verispec.models.quant import PackedWeight

    g = torch.Generator().manual_seed(18)
    w = torch.randn(96, 64, generator=g).bfloat16()
    pw = PackedWeight(w, "int8")
    assert pw.native is not None and not hasattr(pw, "q")
    x = torch.randn(5, 64, generator=g).bfloat16()
    ref = (x.double() @ pw.codes().double().T) * pw.scale.double()
    torch.testing.assert_close(pw.mm(x).double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    assert torch.equal(pw.dequantize(), (pw.codes().float() * pw.scale.float()[:, None]).bfloat16())
    assert pw.nbytes == 96 * 64 + 96 * 2
    assert PackedWeight(w.float(), "int8").native is None  # fp32 activations keep torch's kernel


needs_int4 = pytest.mark.skipif(kernels.int4_gemm() is None, reason=f"native kernels unavailable: {kernels.why_not()}")


@needs_int4
@pytest.mark.parametrize("N,K", [(64, 640), (100, 64), (640, 2048)])
def test_native_int4_gemm_is_x_times_the_dequantized_weight_with_each_row_alone(N, K):
    """int4_gemm.c: x @ ((q - 8) * s + z).T, against the same product in fp64 (within a bf16
    rounding); the packed codes, scales and zeros unpack to what was packed; a row's bits are the
    same among 1-70 rows at any position and on one or two threads; the AVX512 and AVX2 builds
    agree bit for bit."""
    g = torch.Generator().manual_seed(19)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    G = K // kernels.INT4_GROUP
    scale = (torch.rand(N, G, generator=g) / 50 + 1e-3).bfloat16()
    zero = (torch.randn(N, G, generator=g) / 20).bfloat16()
    x = torch.randn(70, K, generator=g).bfloat16()
    packed = kernels.pack_int4(q)
    assert packed.shape == (-(-N // 64), K, 32) and torch.equal(kernels.unpack_int4(packed, N), q)
    scales, zeros = kernels.pack_int4_groups(scale), kernels.pack_int4_groups(zero)
    assert torch.equal(scales.transpose(1, 2).reshape(-1, G)[:N], scale)
    fn = kernels.int4_gemm()
    got = kernels.run_int4_gemm(fn, x, packed, scales, zeros, N)
    w = (q.double().view(N, G, -1) - 8) * scale.double()[..., None] + zero.double()[..., None]
    ref = x.double() @ w.view(N, K).T
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 3, 5, 64, 70):
                for start in (0, 70 - m):
                    part = kernels.run_int4_gemm(fn, x[start : start + m].contiguous(), packed, scales, zeros, N)
                    assert torch.equal(part, got[start : start + m]), (t, m, start)
    finally:
        torch.set_num_threads(threads)
    outs = {}
    for isa, lib in _variants():
        f = lib.verispec_int4_gemm
        f.restype, f.argtypes = None, fn.argtypes
        outs[isa] = kernels.run_int4_gemm(f, x[:7].contiguous(), packed, scales, zeros, N)
    assert all(torch.equal(o, got[:7]) for o in outs.values()), list(outs)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.run_int4_gemm(fn, x[:, :40].contiguous(), packed, scales, zeros, N)


@needs_int4
def test_int4_weights_run_on_the_native_kernel_and_dequantize_to_what_it_computes():
    from verispec.models.quant import PackedWeight

    g = torch.Generator().manual_seed(20)
    w = torch.randn(100, 64, generator=g).bfloat16()  # 100 rows: not a multiple of torch's 16-row tiles
    pw = PackedWeight(w, "int4")
    assert pw.native is not None and not hasattr(pw, "q") and pw.dense is None
    x = torch.randn(5, 64, generator=g).bfloat16()
    ref = x.double() @ pw.dequantize().double().T
    torch.testing.assert_close(pw.mm(x).double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    assert (pw.dequantize().float() - w.float()).abs().max() < 0.5  # a 16-level grid per 32 values
    assert pw.nbytes == 2 * 64 * 32 + 2 * 2 * (2 * 64) * 2  # two 64-row groups of codes, scales and zeros
    assert PackedWeight(w.float(), "int4").native is None  # fp32 activations keep torch's kernel


@pytest.mark.skipif(kernels.argmax_f32() is None, reason=f"native kernels unavailable: {kernels.why_not()}")
def test_native_argmax_is_torchs():
    """The first largest entry of each row, as torch.argmax gives it: ties (the first wins, -0.0 and
    0.0 tie), a NaN anywhere (the first NaN wins), rows of -inf, +inf, lengths that are not a
    multiple of the vector width, and rows read through a stride."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(262_144, generator=g), torch.randn(1000, generator=g).round()]  # many ties
    for V in (1, 15, 17, 64, 65, 1000):
        x = torch.randn(V, generator=g)
        rows += [x, torch.full((V,), float("-inf")), torch.zeros(V)]
        if V > 3:
            y = x.clone()
            y[[1, V - 2]] = float("nan")
            z = x.clone()
            z[[V // 2, V - 1]] = x.max() + 1
            w = x.clone()
            w[V - 1] = float("inf")
            rows += [y, z, w, torch.where(x > 0, torch.tensor(-0.0), torch.tensor(-1.0))]
    for r in rows:
        for batch in (r[None], torch.stack([r, r.flip(0), -r])):
            assert torch.equal(kernels.run_argmax(kernels.argmax_f32(), batch), batch.argmax(-1)), batch
            # bf16 rows: the argmax of their exact fp32 widening (rounding to bf16 adds ties)
            half = batch.to(torch.bfloat16)
            assert torch.equal(kernels.run_argmax(kernels.argmax_bf16(), half), half.float().argmax(-1)), half
    wide = torch.randn(5, 300, generator=g)
    assert torch.equal(kernels.run_argmax(kernels.argmax_f32(), wide[:, 10:250]), wide[:, 10:250].argmax(-1))
    half = wide.to(torch.bfloat16)
    assert torch.equal(kernels.run_argmax(kernels.argmax_bf16(), half[:, 10:250]), half[:, 10:250].float().argmax(-1))
