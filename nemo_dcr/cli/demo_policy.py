"""The demo's policy and its task, plain PyTorch: both demo processes import it.

The task is single-digit addition written as text: the prompt ``"3+4="``, a completion of at
most two digits ended by ``";"``. The reward is verifiable: 1 when the completion is the sum,
0 otherwise. The policy is a small causal transformer over the 13 characters. Its starting
point is a *base model*: trained briefly on answers that are wrong most of the time (off by a
few), so it puts some of its probability on the right answer and RL on the reward has
something to sharpen, as RL fine-tuning of a pretrained LLM does.

The update is GRPO-style: several samples per prompt, the group's mean reward as the baseline
(advantage = (reward - group mean) / group std), and a clipped importance ratio against the
log-probabilities of the policy that sampled (the rollout's weights, one version behind the
trainer's).
"""
from __future__ import annotations

import torch
from torch import nn

VOCAB = "0123456789+=;"
EOS = VOCAB.index(";")
PROMPT_LEN = 4   # "a+b="
MAX_NEW = 3      # up to two digits and ";"
CTX = PROMPT_LEN + MAX_NEW


class PolicyLM(nn.Module):
    """A small pre-norm causal transformer over ``VOCAB``."""

    mask: torch.Tensor  # a registered buffer (nn.Module.__getattr__ is typed Tensor | Module)

    def __init__(self, d: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.emb = nn.Embedding(len(VOCAB), d)
        self.pos = nn.Parameter(torch.zeros(CTX, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, len(VOCAB), bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CTX), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.emb(x) + self.pos[:n]
        h = self.blocks(h, mask=self.mask[:n, :n].to(h.dtype), is_causal=True)
        return self.head(self.norm(h))


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def problems(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` prompts' operands, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (n,), generator=g), torch.randint(0, 10, (n,), generator=g)


def prompts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tensor([encode(f"{x}+{y}=") for x, y in zip(a.tolist(), b.tolist())])


@torch.no_grad()
def sample(model: nn.Module, a: torch.Tensor, b: torch.Tensor, group: int, seed: int):
    """``group`` completions per prompt at temperature 1: tokens [n*group, CTX] and the
    sampling policy's log-probability of each new token [n*group, MAX_NEW] (float32)."""
    g = torch.Generator().manual_seed(seed)
    x = prompts(a, b).repeat_interleave(group, 0)
    logps = []
    for _ in range(MAX_NEW):
        lp = torch.log_softmax(model(x)[:, -1].float(), -1)
        tok = torch.multinomial(lp.exp(), 1, generator=g)
        logps.append(lp.gather(1, tok))
        x = torch.cat([x, tok], 1)
    return x, torch.cat(logps, 1)


def score(tokens: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: int):
    """The verifiable reward (1.0: the completion is the sum followed by ";") and the mask of
    the completion's tokens (up to and including the first ";")."""
    new = tokens[:, PROMPT_LEN:]
    is_eos = new == EOS
    ended = is_eos.any(1)
    length = torch.where(ended, is_eos.int().argmax(1) + 1, torch.full_like(ended, MAX_NEW, dtype=torch.long))
    mask = torch.arange(MAX_NEW)[None, :] < length[:, None]
    want = (a + b).repeat_interleave(group, 0).tolist()
    reward = [float(bool(e) and decode(row[:n - 1]) == str(s))
              for row, n, e, s in zip(new.tolist(), length.tolist(), ended.tolist(), want)]
    return torch.tensor(reward), mask


def token_logprobs(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's log-probability of each completion token [N, MAX_NEW] (with gradients)."""
    logits = model(tokens[:, :-1])[:, PROMPT_LEN - 1:].float()
    return torch.log_softmax(logits, -1).gather(2, tokens[:, PROMPT_LEN:, None]).squeeze(-1)


def grpo_loss(model: nn.Module, tokens, old_logprobs, mask, reward, group: int, clip: float = 0.2):
    """The clipped policy-gradient loss with the group baseline, averaged over completion
    tokens; also the fraction of tokens whose ratio was clipped."""
    r = reward.view(-1, group)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1, 1)
    ratio = (token_logprobs(model, tokens) - old_logprobs).exp()
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    m = mask.float()
    loss = -(obj * m).sum() / m.sum()
    clipped = ((ratio - 1).abs() > clip).float()
    return loss, float((clipped * m).sum() / m.sum())


def warm_up(model: nn.Module, steps: int, wrong: float = 0.6, lr: float = 2e-3, seed: int = 0) -> float:
    """The base model: ``steps`` supervised AdamW steps on sums that are off by -3..3 in a
    ``wrong`` share of the examples. Returns the last loss."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        a, b = torch.randint(0, 10, (64,), generator=g), torch.randint(0, 10, (64,), generator=g)
        noisy = torch.rand(64, generator=g) < wrong
        s = torch.where(noisy, a + b + torch.randint(-3, 4, (64,), generator=g), a + b).clamp(min=0)
        x, m = _examples(a, b, s)
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits[m], x[:, 1:][m])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def _examples(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of ``"a+b=s;"`` [n, CTX] (padded with ";") and the mask of the positions whose next
    token is part of the answer [n, CTX - 1]."""
    two = s >= 10
    x = torch.stack([a, torch.full_like(a, VOCAB.index("+")), b, torch.full_like(a, VOCAB.index("=")),
                     torch.where(two, s // 10, s), torch.where(two, s % 10, EOS), torch.full_like(a, EOS)], 1)
    m = torch.zeros(len(a), CTX - 1, dtype=torch.bool)
    m[:, PROMPT_LEN - 1:PROMPT_LEN + 1] = True
    m[:, PROMPT_LEN + 1] = two
    return x, m
