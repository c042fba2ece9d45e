"""
Muon (optimizer='muon'): PyTorch's torch.optim.Muon for the Blocks' 2-D matrices with AdamW for the
rest (MuonWithAdamW), and its orthogonalisation in float32 on the CPU, batched by shape
(newton_schulz_float32, orthogonalise). Imported only by runs that use Muon; optimizer.py's
make_optimizer builds it.

Usage:
    from nanogpt_plus.muon import MuonWithAdamW, orthogonalise
    updates = orthogonalise(momenta)   # each matrix made orthogonal (its singular values ~1)
"""

import contextlib

import torch

try:  # torch.optim.Muon's module (PyTorch 2.9 on); optimizer='muon' needs it
    import torch.optim._muon as muon_impl
except ImportError:
    muon_impl = None


def newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """
    torch.optim.Muon's orthogonalisation (the same quintic Newton-Schulz iteration, the same
    coefficients and steps) computed in float32 instead of bfloat16. tests/test_muon.py checks it
    against PyTorch's own.
    """
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T  # iterate on the wide orientation: its Gram matrix x x^T is the smaller one
    # spectral norm <= Frobenius norm <= 1: inside the iteration's range
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        # a x + (b G + c G^2) x
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def gram_newton_schulz(x, ns_coefficients, ns_steps):
    """
    The Newton-Schulz steps of a stack of wide matrices x (m x n, m < n, each of spectral norm <= 1)
    taken on their m x m Gram matrices. A step is x <- P x with P = a I + b G + c G^2 and G = x x^T,
    so the steps' end is Q x0, Q the product of the P's; the next G is P G P (P, a polynomial in G,
    commutes with it). The same polynomial as the plain steps with m x m products in place of m x n
    ones: for s steps 4 m^2 n + (8 s - 6) m^3 operations against s (4 m^2 n + 2 m^3), half for the
    MLP's 4:1 matrices, fewer wherever n > 1.5 m.
    """
    a, b, c = ns_coefficients
    g = x @ x.mT
    q = None
    for step in range(ns_steps):
        p = torch.baddbmm(g, g, g, beta=b, alpha=c)
        p.diagonal(dim1=-2, dim2=-1).add_(a)
        q = p if q is None else p @ q
        if step < ns_steps - 1:
            g = p @ g @ p
    return x if q is None else q @ x


def orthogonalise(matrices, ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-7,
                  gram=True):
    """
    newton_schulz_float32 of each matrix, with the matrices of one shape (in their wide orientation,
    m x n) stacked and iterated together: 3 batched matmuls per step for each shape instead of 3 per
    matrix. gram: where n > 1.5 m, where it takes fewer operations, iterate on the Gram matrices
    (gram_newton_schulz).
    """
    out = [None] * len(matrices)
    by_shape = {}
    for i, m in enumerate(matrices):
        tall = m.size(0) > m.size(1)
        by_shape.setdefault((tall, *m.shape), []).append(i)
    a, b, c = ns_coefficients
    for (tall, *_), idx in by_shape.items():
        x = torch.stack([matrices[i].float() for i in idx])
        if tall:
            x = x.mT
        x = x / x.flatten(1).norm(dim=1).clamp(min=eps)[:, None, None]
        if gram and 2 * x.size(2) > 3 * x.size(1):
            x = gram_newton_schulz(x, ns_coefficients, ns_steps)
        else:
            for _ in range(ns_steps):
                gram_matrix = x @ x.mT
                x = torch.baddbmm(x,
                                  torch.baddbmm(gram_matrix,
                                                gram_matrix,
                                                gram_matrix,
                                                beta=b,
                                                alpha=c),
                                  x,
                                  beta=a)
        if tall:
            x = x.mT
        for j, i in enumerate(idx):
            out[i] = x[j]
    return out


@contextlib.contextmanager
def float32_newton_schulz(enabled=True):
    """
    Within it, torch.optim.Muon orthogonalises in float32 (newton_schulz_float32). PyTorch's Muon
    casts to bfloat16, which GPUs multiply at full speed but a CPU without AVX-512 BF16 does not: on
    this project's AMD EPYC (AVX2) the 16 matrices of the laptop Shakespeare model take ~900 ms in
    bfloat16, ~40 ms in float32. The optimizer (momentum, Nesterov, learning-rate adjustment, weight
    decay, state) stays PyTorch's.
    """
    original = getattr(muon_impl, '_zeropower_via_newtonschulz', None) if muon_impl else None
    if not enabled or original is None:  # a PyTorch that has moved it: keep its own
        yield
        return
    muon_impl._zeropower_via_newtonschulz = newton_schulz_float32
    try:
        yield
    finally:
        muon_impl._zeropower_via_newtonschulz = original


class MuonWithAdamW:
    """
    Muon (Jordan et al. 2024; PyTorch's torch.optim.Muon) for the hidden matrices, the 2-D weights
    inside the Blocks: each update is the momentum of the gradient made orthogonal (its singular
    values set to ~1) by a few Newton-Schulz steps, so every direction of a matrix learns at the
    same rate. Muon is for such matrices only; the embeddings, the head and the vectors (gains,
    biases) keep AdamW, made by adamw(params=...) (configure_optimizers' two groups at
    learning_rate). One object with the optimizer interface the loop, the GradScaler and the
    checkpoints use (param_groups, step, zero_grad, state_dict, load_state_dict). Its state dict
    holds each of its parts' ({'muon': ..., 'adamw': ...}), so a resume continues both exactly.
    float32_ns: orthogonalise in float32 (the CPU; see float32_newton_schulz).
    """

    def __init__(self, model, adamw, learning_rate, muon_lr, momentum, muon_weight_decay,
                 ns_steps=5, float32_ns=False):
        hidden = [p for n, p in model.named_parameters()
                  if p.requires_grad and p.dim() == 2 and n.startswith('transformer.h.')]
        hidden_ids = {id(p) for p in hidden}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in hidden_ids]
        print(f"muon: {len(hidden)} matrices with {sum(p.numel() for p in hidden):,} parameters; "
              f"adamw: {len(rest)} tensors with {sum(p.numel() for p in rest):,} parameters")
        # lr_ratio: set_learning_rate gives Muon the schedule's rate times muon_lr / learning_rate
        self.muon = torch.optim.Muon([{
            'params': hidden,
            'lr_ratio': muon_lr / learning_rate
        }],
                                     lr=muon_lr,
                                     momentum=momentum,
                                     weight_decay=muon_weight_decay,
                                     ns_steps=ns_steps)
        self.adamw = adamw(params=rest)
        # what state_dict holds, and load_optimizer_state loads
        self.parts = {'muon': self.muon, 'adamw': self.adamw}
        self.float32_ns = float32_ns

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    def step(self, closure=None):
        # the CPU, where this PyTorch has the parts the batched step uses
        if self.float32_ns and hasattr(muon_impl, '_adjust_lr'):
            self.muon_step_batched()
        else:  # PyTorch's own step (on the CPU with its orthogonalisation in float32)
            with float32_newton_schulz(self.float32_ns):
                self.muon.step()
        self.adamw.step()

    @torch.no_grad()
    def muon_step_batched(self):
        """
        torch.optim.Muon's step (its _single_tensor_muon: Nesterov momentum, the orthogonalised
        update, the learning-rate adjustment, decoupled weight decay), with the matrices'
        orthogonalisations batched by shape and the wide ones iterated on their Gram matrices
        (orthogonalise): on a 2-core CPU the laptop model's 16 take 11 ms, against 19 ms one by one.
        The state is PyTorch's (a 'momentum_buffer' per matrix), so checkpoints are the same as with
        its step.
        """
        for group in self.muon.param_groups:
            params = [p for p in group['params'] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.muon.state[p]
                if 'momentum_buffer' not in state:
                    state['momentum_buffer'] = torch.zeros_like(p.grad,
                                                                memory_format=torch.preserve_format)
                bufs.append(state['momentum_buffer'])
            momentum, lr = group['momentum'], group['lr']
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = [g.lerp(b, momentum)
                       for g, b in zip(grads, bufs)] if group['nesterov'] else bufs
            updates = orthogonalise(updates, group['ns_coefficients'], group['ns_steps'],
                                    group['eps'])
            for p, update in zip(params, updates):
                p.mul_(1 - lr * group['weight_decay'])
                p.add_(update, alpha=-muon_impl._adjust_lr(lr, group['adjust_lr_fn'], p.shape))

    def zero_grad(self, set_to_none=True):
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state_dict):
        if set(state_dict) != set(self.parts):
            raise ValueError(
                "not a Muon+AdamW optimizer state (a checkpoint of an optimizer='adamw' run?)")
        for name, opt in self.parts.items():
            opt.load_state_dict(state_dict[name])
