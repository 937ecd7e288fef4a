"""Vocabulary-parallel outputs at TP=2 against core's full-vocabulary helpers on peaked (far from
uniform) logits with a padded vocabulary: values and gradients of log-probs, entropy and the sum
of squared probabilities, and the top-k outputs distillation reads."""

from __future__ import annotations

import torch
from ranks import run_ranks

from trellis.interfaces.dispatch import Mesh
from trellis.interfaces.hf import entropy_from_logits, sum_sq_probs_from_logits

VOCAB, PADDED = 11, 12  # Megatron pads the vocabulary to a multiple of tp


def logits_and_tokens():
    g = torch.Generator().manual_seed(0)
    return 4 * torch.randn(3, 5, VOCAB, generator=g, dtype=torch.float64), torch.randint(0, VOCAB, (3, 5), generator=g)


def weights():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3)]


def _shard_outputs(info):
    from trellis_megatron import outputs
    from trellis_megatron.distributed import init_parallel

    init_parallel(info)
    z, tokens = logits_and_tokens()
    padded = torch.cat([z, torch.zeros(3, 5, PADDED - VOCAB, dtype=z.dtype)], -1)  # the padding rows' logits
    local = padded.chunk(info.mesh.tp, -1)[info.rank].clone().requires_grad_()
    masked = outputs.mask_padding(local, VOCAB)
    values = [outputs.log_probs(masked, tokens), outputs.entropy(masked), outputs.sum_sq_probs(masked)]
    sum(v * w for v, w in zip(values, weights())).sum().backward()
    return [v.detach() for v in values], local.grad


def test_vocab_parallel_outputs_and_gradients_equal_full_vocabulary():
    z, tokens = logits_and_tokens()
    z = z.clone().requires_grad_()
    want = [torch.log_softmax(z, -1).gather(-1, tokens[..., None])[..., 0], entropy_from_logits(z), sum_sq_probs_from_logits(z)]
    sum(v * w for v, w in zip(want, weights())).sum().backward()
    for mesh in (Mesh(), Mesh(tp=2)):
        results = run_ranks(_shard_outputs, mesh)
        for values, _ in results:
            for got, expected in zip(values, want):
                # log-probs go through Megatron's cross entropy, which computes in float32
                torch.testing.assert_close(got.double(), expected.detach(), atol=1e-6, rtol=1e-6)
        grad = torch.cat([g for _, g in results], -1)
        torch.testing.assert_close(grad[..., :VOCAB].double(), z.grad, atol=1e-6, rtol=1e-6)
        assert torch.all(grad[..., VOCAB:] == 0)  # padding columns get no gradient


def _shard_top(info):
    from trellis_megatron import outputs
    from trellis_megatron.distributed import init_parallel

    init_parallel(info)
    z, _ = logits_and_tokens()
    padded = torch.cat([z, torch.zeros(3, 5, PADDED - VOCAB, dtype=z.dtype)], -1)
    local = padded.chunk(info.mesh.tp, -1)[info.rank].clone().requires_grad_()
    masked = outputs.mask_padding(local, VOCAB)
    tops = {k: outputs.top_log_probs(masked, k, VOCAB) for k in (4, 0)}
    at = outputs.log_probs_at(masked, tops[4][1])
    (at * weights()[0][..., None]).sum().backward()
    return tops, at.detach(), local.grad


def test_vocab_parallel_top_k_and_log_probs_at_ids_equal_full_vocabulary():
    """The teacher's top-k (k 4, and 0: the whole true vocabulary, never a padding column) and the
    student's log-probs at those ids with their gradient, at TP=1 and 2."""
    z, _ = logits_and_tokens()
    z = z.clone().requires_grad_()
    full = torch.log_softmax(z, -1)
    want = {k: full.detach().topk(k or VOCAB, -1) for k in (4, 0)}
    at = full.gather(-1, want[4].indices)
    (at * weights()[0][..., None]).sum().backward()
    for mesh in (Mesh(), Mesh(tp=2)):
        results = run_ranks(_shard_top, mesh)
        for tops, got_at, _ in results:
            for k, (values, ids) in tops.items():
                torch.testing.assert_close(values.double(), want[k].values, atol=1e-6, rtol=1e-6)
                assert torch.equal(ids, want[k].indices) and ids.max() < VOCAB, k
            torch.testing.assert_close(got_at.double(), at.detach(), atol=1e-6, rtol=1e-6)
        grad = torch.cat([g for _, _, g in results], -1)
        torch.testing.assert_close(grad[..., :VOCAB].double(), z.grad, atol=1e-6, rtol=1e-6)
        assert torch.all(grad[..., VOCAB:] == 0)
