"""Small models the drop-in and compile tests share: a module of torch's own layers that FORGE
fuses (an embedding with a padding row, a biased and an unbiased linear, a head), and its
loss; transformers' GPT-2 at a tiny size."""
import torch
from torch import nn


class Net(nn.Module):
    """Embedding (padding row 0), a biased and an unbiased linear, optionally a LayerNorm,
    a head."""

    def __init__(self, vocab=37, h=16, norm=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, h, padding_idx=0)
        self.up = nn.Linear(h, 2 * h)
        self.down = nn.Linear(2 * h, h, bias=False)
        self.norm = nn.LayerNorm(h) if norm else nn.Identity()
        self.head = nn.Linear(h, vocab)

    def forward(self, ids):
        return self.head(self.norm(self.down(torch.tanh(self.up(self.emb(ids))))))


def next_token_loss(model, ids):
    """Cross-entropy of model(ids) against ids rolled by one, in fp32 at least (a float64
    model's stays float64: the reference of tests/closeness.py)."""
    logits = model(ids)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       ids.roll(1, -1).reshape(-1))


def tiny_gpt2():
    """transformers' GPT-2: its attention and MLP matrices live in Conv1D modules (y = x W + b,
    W [in, out]); its LM head is tied to the token embedding. No dropout, so that the runs see
    one function."""
    import transformers
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97,
                                  n_positions=16, bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()
