"""Joint text+visual attention on any backend: the method runs on the visual tokens, and every softmax branch it
computes also attends the text keys densely, in one softmax (``flexsparse.Joint``)."""
from __future__ import annotations

import torch

from ..masks import BlockSelection, num_blocks
from .base import Backend, merge_by_lse

TEXT_BLOCK = 64   # query and text-key block of the text branch: a tile every backend runs


class WithTextKeys:
    """``backend`` whose softmax branches (dense, block-sparse, LLSA, SLA2's soft router) also attend the text keys
    ``k_text``, ``v_text`` ``(B, Hk, n_t, D)``: each branch's output merges by LSE with dense attention over them, one
    softmax over both key sets. Steps that fuse a softmax branch with another (``sparse_linear_output``) decline, so
    the method runs the branches apart and the linear branches (SLA, SLA2) and VSA's coarse branch see the visual
    tokens only. The reference backend runs the method's steps as well (its dense specs have no text keys).
    ``text_mask``: ``(B, n_t)`` bool, False for padding text keys, which no query attends; the text branch then runs
    as the backend's masked dense attention (SDPA and a row-chunked LSE) instead of its block-sparse kernel."""

    def __init__(self, backend: Backend, k_text: torch.Tensor, v_text: torch.Tensor,
                 text_mask: torch.Tensor | None = None):
        self._backend, self._k_text, self._v_text, self._text_mask = backend, k_text, v_text, text_mask

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def attend(self, method, q, k, v, selection, cfg, **kwargs):
        return method.attend(q, k, v, selection, cfg, self, **kwargs)

    def dense_attention(self, q, k, v, scale: float, need_lse: bool):
        return self._with_text(q, scale, self._backend.dense_attention(q, k, v, scale, need_lse=True))

    def block_sparse_attention(self, q, k, v, selection, scale: float, **kwargs):
        return self._with_text(q, scale, self._backend.block_sparse_attention(q, k, v, selection, scale, **kwargs))

    def llsa_attention(self, q, k, v, pooled, scale: float, **kwargs):
        return self._with_text(q, scale, self._backend.llsa_attention(q, k, v, pooled, scale, **kwargs))

    def soft_block_attention(self, q, k, v, log_weights, block_q: int, block_k: int, scale: float):
        branch = self._backend.soft_block_attention(q, k, v, log_weights, block_q, block_k, scale)
        return self._with_text(q, scale, branch)

    def sparse_linear_output(self, *args, **kwargs):
        return None

    def _with_text(self, q: torch.Tensor, scale: float, branch):
        o, lse = branch
        if lse is None:
            raise ValueError(f"joint attention merges by the softmax branch's LSE, which backend "
                             f"{self._backend.name!r} does not give for this call")
        return merge_by_lse(o, lse, *self._text_attention(q, scale))

    def _text_attention(self, q: torch.Tensor, scale: float):
        """Dense attention of q over the text keys with its LSE, as the backend's block-sparse branch with every
        text block selected: one fused kernel with its LSE and LSE gradient on triton and flex. ``dense_attention``
        computes its LSE apart, in row chunks: joint calls through it took 42-49 ms forward+backward against 3.9 ms
        for the visual tokens alone (H200, B1 H16 D64 bf16, 65536 visual and 512 text tokens, llsa and topk)."""
        if self._text_mask is not None:
            return self._backend.dense_attention(q, self._k_text, self._v_text, scale, need_lse=True,
                                                 key_mask=self._text_mask)
        bsz, heads, n_q, _ = q.shape
        n_text = self._k_text.shape[2]
        every = torch.arange(num_blocks(n_text, TEXT_BLOCK), dtype=torch.int32, device=q.device)
        indices = every.expand(bsz, heads, num_blocks(n_q, TEXT_BLOCK), -1).contiguous()
        selection = BlockSelection(indices, TEXT_BLOCK, TEXT_BLOCK, n_q, n_text)
        return self._backend.block_sparse_attention(q, self._k_text, self._v_text, selection, scale)
