"""Joint text+visual attention (``flexsparse.Joint``) against dense references built here, every method and backend.

Expected results, fp64: text queries attend every key (SDPA); a visual query's softmax branch gains the text keys,
so its output is the method's dense reference on the visual tokens with the sparse branch ``o_s`` (the dense
block-sparse reference on the method's selection) replaced by the one softmax over ``o_s``'s keys and the text keys
(written out here from the two LSEs), scaled as the method combines it (1, or SLA2's alpha). Gradients of q, k, v and
of learned parameters are compared through these differentiable references.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flexsparse as fs
import triton_support as ts
from flexsparse.backends import BACKENDS
from flexsparse.backends.base import merge_by_lse
from flexsparse.methods.dense import block_sparse_dense
from helpers import SMALL_CONFIGS as CONFIGS, qkv, rel_err

HEADS, KV_HEADS, D = 4, 2, 16


def test_every_registered_method_has_a_case():
    assert set(CONFIGS) == set(fs.METHODS)


def test_merge_by_lse_is_one_softmax_over_both_key_sets():
    q, k, v = qkv(heads=2, n=50, d=8, requires_grad=True)
    split = 21
    parts = [BACKENDS["torch"].dense_attention(q, k[:, :, s], v[:, :, s], 0.3, need_lse=True)
             for s in (slice(0, split), slice(split, None))]
    out, lse = merge_by_lse(*parts[0], *parts[1])
    want = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    want_lse = torch.logsumexp(0.3 * q @ k.transpose(-1, -2), dim=-1)
    assert rel_err(out, want) < 1e-13 and rel_err(lse, want_lse) < 1e-13
    grad, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * grad).sum() + (lse * grad_lse).sum(), (q, k, v))
    expected = torch.autograd.grad((want * grad).sum() + (want_lse * grad_lse).sum(), (q, k, v))
    for a, b in zip(got, expected):
        assert rel_err(a, b) < 1e-12


def sparse_branch(name, q, k, v, cfg, params, scale):
    """``(o_s, coefficient)``: the dense reference of the method's softmax branch on its own selection, and the
    factor the method's output carries it with (``None`` where the output is the branch itself)."""
    method = fs.METHODS[name]
    if name in ("full", "llsa"):
        return None, None
    fitted = method.fit(fs.Config.from_dict(cfg), q.shape[2], k.shape[2])
    checked = method.check_params(fitted, q, params)
    selection = method.select(q, k, v, fitted, BACKENDS["torch"], checked)
    if name == "vsa":
        return block_sparse_dense(q, k, v, selection.blocks, scale)[0], 1.0
    if name == "sla2":
        alpha = torch.sigmoid(checked["alpha_logit"]).repeat_interleave(fitted.block_q, -1)[:, :q.shape[2]]
        return block_sparse_dense(q, selection.keys, v, selection.mask, scale)[0], alpha[None, :, :, None]
    return block_sparse_dense(q, k, v, selection, scale)[0], 1.0


def expected_joint(name, q, k, v, cfg, params, text: str, length: int, scale, mask=None):
    """``(o, lse)`` of joint attention from dense references (module docstring); ``mask`` ``(B, length)``: the text
    keys attended (padding False), a batch row without any giving visual queries the method's output alone."""
    n = q.shape[2]
    t, vis = (slice(0, length), slice(length, n)) if text == "prefix" else (slice(n - length, n), slice(0, n - length))
    q_v, k_v, v_v = q[:, :, vis], k[:, :, vis], v[:, :, vis]
    o_plain, lse_s = fs.attention(q_v, k_v, v_v, cfg, backend="reference", scale=scale, return_lse=True,
                                  params=params)
    heads = q.shape[1] // k.shape[1]
    k_t, v_t = (x[:, :, t].repeat_interleave(heads, 1) for x in (k, v))
    logits_t = scale * q_v @ k_t.transpose(-1, -2)
    empty = torch.zeros(q.shape[0], 1, 1, dtype=torch.bool, device=q.device)
    if mask is not None:    # a row without text keys: its softmax over them is replaced (finite gradients)
        empty = ~mask.any(-1)[:, None, None]
        logits_t = logits_t.masked_fill(~(mask | empty[:, 0])[:, None, None, :], float("-inf"))
    lse_t = torch.where(empty, float("-inf"), torch.logsumexp(logits_t, dim=-1))
    o_t = torch.softmax(logits_t, dim=-1) @ v_t
    weights = torch.softmax(torch.stack([lse_s, lse_t]), dim=0).unsqueeze(-1)      # the two key sets' shares
    o_s, coefficient = sparse_branch(name, q_v, k_v, v_v, cfg, params, scale)
    if o_s is None:
        o_visual = weights[0] * o_plain + weights[1] * o_t
    else:
        o_visual = o_plain + coefficient * (weights[0] * o_s + weights[1] * o_t - o_s)
    lse_visual = torch.logaddexp(lse_s, lse_t)
    k_all, v_all = (x.repeat_interleave(heads, 1) for x in (k, v))
    logits = scale * q[:, :, t] @ k_all.transpose(-1, -2)
    if mask is not None:
        logits[..., t] = logits[..., t].masked_fill(~mask[:, None, None, :], float("-inf"))
    o_text, lse_text = torch.softmax(logits, dim=-1) @ v_all, torch.logsumexp(logits, dim=-1)
    order = (0, 1) if text == "prefix" else (1, 0)
    return (torch.cat([(o_text, o_visual)[i] for i in order], dim=2),
            torch.cat([(lse_text, lse_visual)[i] for i in order], dim=2))


def learned(name, cfg, n, d=D):
    initial = fs.METHODS[name].init_params(fs.Config.from_dict(cfg), d, HEADS, n)
    return {key: (value.double() + 0.1 * torch.randn(value.shape, dtype=torch.float64)).requires_grad_()
            for key, value in initial.items()}


@pytest.mark.parametrize("text, length, n", [("prefix", 7, 90), ("suffix", 13, 77), ("prefix", 1, 65)],
                         ids=["prefix-7", "suffix-13", "class-token"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_joint_attention_equals_the_dense_references(name, text, length, n):
    cfg, scale = CONFIGS[name], 0.3
    q, k, v = qkv(batch=2, heads=HEADS, kv_heads=KV_HEADS, n=n, d=D, requires_grad=True)
    params = learned(name, cfg, n - length)
    leaves = [q, k, v, *params.values()]
    want, want_lse = expected_joint(name, q, k, v, cfg, params or None, text, length, scale)
    grad, grad_lse = torch.randn_like(want), torch.randn_like(want_lse)
    expected = torch.autograd.grad((want * grad).sum() + (want_lse * grad_lse).sum(), leaves, allow_unused=True)
    for backend in [b for b in ("torch", "reference", "triton") if b in fs.METHODS[name].backends]:
        with ts.triton_ops_on_cpu():
            out, lse = fs.attention(q, k, v, cfg, backend=backend, scale=scale, return_lse=True,
                                    params=params or None, joint={"text": text, "length": length})
        got = torch.autograd.grad((out * grad).sum() + (lse * grad_lse).sum(), leaves, allow_unused=True)
        where = f"{name} on {backend}"
        assert rel_err(out, want) < 1e-12, where
        assert (lse - want_lse).abs().max() < 1e-12, where
        for label, a, b in zip(["q", "k", "v", *params], got, expected):
            assert (a is None) == (b is None), f"{where}: gradient of {label}"   # SLA2's router: selection only
            assert a is None or rel_err(a, b) < 1e-11, f"{where}: gradient of {label}"


@pytest.mark.parametrize("text, length, n", [("suffix", 13, 77), ("prefix", 9, 70)], ids=["suffix-13", "prefix-9"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_padding_text_keys_are_attended_by_no_query(name, text, length, n):
    """``Joint(mask=)``: prompts of 13, 4 and 0 valid tokens (padding at the end, as HunyuanVideo's model pads them)
    against the dense references with that key padding, outputs, LSE and gradients; a row without valid text gives
    its visual queries the method's output alone."""
    cfg, scale = CONFIGS[name], 0.3
    q, k, v = qkv(batch=3, heads=HEADS, kv_heads=KV_HEADS, n=n, d=D, requires_grad=True)
    mask = torch.arange(length) < torch.tensor([[length], [4], [0]])
    params = learned(name, cfg, n - length)
    leaves = [q, k, v, *params.values()]
    want, want_lse = expected_joint(name, q, k, v, cfg, params or None, text, length, scale, mask)
    assert want.isfinite().all()
    grad, grad_lse = torch.randn_like(want), torch.randn_like(want_lse)
    expected = torch.autograd.grad((want * grad).sum() + (want_lse * grad_lse).sum(), leaves, allow_unused=True)
    for backend in [b for b in ("torch", "reference", "triton") if b in fs.METHODS[name].backends]:
        with ts.triton_ops_on_cpu():
            out, lse = fs.attention(q, k, v, cfg, backend=backend, scale=scale, return_lse=True,
                                    params=params or None, joint=fs.Joint(text, length, mask))
        got = torch.autograd.grad((out * grad).sum() + (lse * grad_lse).sum(), leaves, allow_unused=True)
        where = f"{name} on {backend}"
        assert rel_err(out, want) < 1e-12 and (lse - want_lse).abs().max() < 1e-12, where
        for label, a, b in zip(["q", "k", "v", *params], got, expected):
            assert (a is None) == (b is None), f"{where}: gradient of {label}"
            assert a is None or rel_err(a, b) < 1e-11, f"{where}: gradient of {label}"


def test_joint_full_is_dense_attention_and_length_zero_is_no_joint():
    q, k, v = qkv(heads=HEADS, kv_heads=KV_HEADS, n=40, d=D)
    dense = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    joint = fs.attention(q, k, v, {"method": "full"}, backend="torch", joint=fs.Joint("suffix", 9))
    assert rel_err(joint, dense) < 1e-13
    plain = fs.attention(q, k, v, CONFIGS["topk"], backend="torch")
    assert torch.equal(fs.attention(q, k, v, CONFIGS["topk"], backend="torch", joint={"text": "prefix", "length": 0}),
                       plain)


def test_joint_text_keys_reach_every_visual_query():
    """A text key that dominates every score takes nearly all of every query's attention: selection on the visual
    tokens cannot drop it, though its block pools lowest (top-K over the whole sequence drops it)."""
    q, k, v = qkv(heads=2, n=70, d=D)
    direction = F.normalize(torch.randn(D, dtype=torch.float64), dim=0)
    q = 3 * direction + 0.1 * q                                  # every query near one direction
    sign = torch.tensor([1.0, -1, -1, -1, -1, -1], dtype=torch.float64)
    text = 40 * sign[:, None] * direction                       # one text key along it, five against it
    k = torch.cat([text.expand(2, 2, 6, D), k[:, :, 6:]], dim=2)
    out = fs.attention(q, k, v, CONFIGS["topk"], backend="torch", joint={"text": "prefix", "length": 6})
    text_only = F.scaled_dot_product_attention(q, k[:, :, :6], v[:, :, :6])
    assert rel_err(out[:, :, 6:], text_only[:, :, 6:]) < 1e-6
    unjoined = fs.attention(q, k, v, CONFIGS["topk"], backend="torch")
    assert rel_err(unjoined[:, :, 6:], text_only[:, :, 6:]) > 0.5


@pytest.mark.parametrize("joint, error, match", [
    ({"text": "middle", "length": 3}, ValueError, r"'joint.text' must be one of \['prefix', 'suffix'\]"),
    ({"text": "prefix", "length": -1}, ValueError, r"'joint.length' must be >= 0"),
    ({"text": "prefix", "length": 2.0}, TypeError, r"'joint.length' must be an int"),
    ({"text": "prefix"}, ValueError, r"joint takes the keys 'text', 'length' and optionally 'mask'"),
    ({"text": "prefix", "length": 3, "mask": torch.ones(2, 3)}, ValueError, r"joint.mask must be a bool tensor of "
     r"shape \(batch, 3\) \(True: a text token to attend, False: padding\), got a torch.float32 tensor"),
    ({"text": "prefix", "length": 3, "mask": torch.ones(1, 3, dtype=torch.bool)}, ValueError,
     r"joint.mask must have one row per batch element of q on its device: \(2, 3\)"),
    ({"text": "prefix", "length": 32}, ValueError, r"joint.length=32 text tokens leave no visual token in a sequence"),
    ("prefix", TypeError, r"joint must be a flexsparse.Joint"),
])
def test_bad_joint_names_the_argument(joint, error, match):
    q, k, v = qkv(n=32, d=8)
    with pytest.raises(error, match=match):
        fs.attention(q, k, v, CONFIGS["topk"], joint=joint)


def test_joint_is_self_attention():
    q, _, _ = qkv(n=32, d=8)
    _, k, v = qkv(n=40, d=8)
    with pytest.raises(ValueError, match="joint attention is self-attention over one sequence"):
        fs.attention(q, k, v, {"method": "full"}, joint={"text": "prefix", "length": 4})


def test_sparse_attention_module_takes_joint():
    module = fs.SparseAttention(CONFIGS["sla"], head_dim=D, num_heads=2).double()
    q, k, v = qkv(heads=2, n=60, d=D)
    joint = fs.Joint("prefix", 5)
    assert torch.equal(module(q, k, v, joint=joint),
                       fs.attention(q, k, v, CONFIGS["sla"], params=dict(module.params.items()), joint=joint))


def test_joint_compiles_in_one_graph():
    module = fs.SparseAttention(CONFIGS["llsa"], head_dim=D, num_heads=2, backend="torch")
    q, k, v = qkv(heads=2, n=70, d=D, dtype=torch.float32)

    def call(q, k, v):
        return module(q, k, v, joint=fs.Joint("suffix", 6))
    torch._dynamo.reset()
    assert torch._dynamo.explain(call)(q, k, v).graph_break_count == 0
    torch.testing.assert_close(torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v), call(q, k, v))


GPU_CONFIGS = {
    "topk": {"method": "topk", "block_size": 64, "topk": 4},
    "vsa": {"method": "vsa", "block_size": 64, "topk": 4, "gate": True},
    "llsa": {"method": "llsa", "block_size": 16, "topk": [4, 2]},
    "sla": {"method": "sla", "block_size": 64, "topk_ratio": 0.2},
    "sla2": {"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": 0.2},
}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flex"])
@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_joint_bf16_against_fp64_references(name, backend):
    """bf16 on CUDA, a 77-token text suffix, GQA: outputs and gradients against the fp64 dense references on the
    same (bf16-valued) inputs."""
    if backend not in fs.METHODS[name].backends:
        pytest.skip(f"{name} has no {backend} backend")
    cfg, scale, n, length = GPU_CONFIGS[name], 0.125, 1000, 77
    q, k, v = qkv(batch=1, heads=HEADS, kv_heads=KV_HEADS, n=n, d=64, seed=7)
    q, k, v = (x.to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v))
    params = {key: value.detach().float().cuda().requires_grad_()
              for key, value in learned(name, cfg, n - length, 64).items()}
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    p64 = {key: value.detach().double().requires_grad_() for key, value in params.items()}
    want, _ = expected_joint(name, q64, k64, v64, cfg, p64 or None, "suffix", length, scale)
    grad = torch.randn_like(want)
    expected = torch.autograd.grad((want * grad).sum(), [q64, k64, v64], allow_unused=True)
    out = fs.attention(q, k, v, cfg, backend=backend, scale=scale, params=params or None,
                       joint=fs.Joint("suffix", length))
    got = torch.autograd.grad((out * grad.to(out.dtype)).sum(), [q, k, v])
    assert rel_err(out, want) < 1e-2, "output"
    for label, a, b in zip("qkv", got, expected):
        assert rel_err(a, b) < 3e-2, f"gradient of {label}"
