"""
The spike guard (llm.c's -sl / -sg): skip the update of a step whose loss or gradient norm is an
outlier against its recent history, so one bad batch or a numerical blow-up costs one step instead
of the run.

Usage:
    from nanogpt_plus.spike_guard import SpikeGuard
    guard = SpikeGuard(skip_loss_z=5.0, skip_grad_z=5.0)
    spike = guard.check(loss, grad_norm)  # None: take the update; else a Spike to report
"""

import math

SPIKE_WINDOW = 128  # the running statistics cover the last 128 steps, as llm.c's OutlierDetector


class SpikeGuard:
    """
    Skips an update whose loss (or gradient norm) lies more than skip_loss_z (skip_grad_z) standard
    deviations above the mean of the last SPIKE_WINDOW steps: one bad batch or a numerical blow-up
    then costs one step instead of the run. 0 turns a check off. As in llm.c, z is undefined
    (nothing is skipped) until the window is full, every finite value enters the window, skipped or
    not (so a lasting shift in the loss is soon the new normal), and non-finite values never do
    (those stop the run elsewhere, or are the float16 GradScaler's to skip). The state is plain
    lists of floats, for weights_only checkpoints.

        guard = SpikeGuard(skip_loss_z=5.0, skip_grad_z=5.0)
        spike = guard.check(loss, grad_norm)  # None: take the update; else a Spike to report
    """

    def __init__(self, skip_loss_z=0.0, skip_grad_z=0.0, window=SPIKE_WINDOW):
        self.limits = {'loss': float(skip_loss_z), 'grad_norm': float(skip_grad_z)}
        self.window = window
        # the last `window` finite values of each, oldest first
        self.history = {'loss': [], 'grad_norm': []}
        self.skipped = 0  # updates skipped so far in the run (a resumed run goes on counting)

    @property
    def enabled(self):
        return any(z > 0 for z in self.limits.values())

    def z_score(self, name, value):
        """
        How many standard deviations value lies above the window's mean (None: window not full, or
        flat).
        """
        values = self.history[name]
        if value is None or not math.isfinite(value) or len(values) < self.window:
            return None
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        return (value - mean) / std if std > 0 else None

    def check(self, loss, grad_norm=None):
        """ Judge one step (grad_norm None: not measured), then add its values to the windows. """
        values = {'loss': loss, 'grad_norm': grad_norm}
        stats = {
            name: (value, self.z_score(name, value), self.mean(name))
            for name, value in values.items()
        }
        for name, value in values.items():
            if value is not None and math.isfinite(value):
                self.history[name] = (self.history[name] + [float(value)])[-self.window:]
        outliers = [
            name for name, (_, z, _) in stats.items() if z is not None and 0 < self.limits[name] < z
        ]
        if not outliers:
            return None
        self.skipped += 1
        return Spike(stats, outliers, self.limits)

    def mean(self, name):
        values = self.history[name]
        return sum(values) / len(values) if values else None

    def state_dict(self):
        return {'loss': list(self.history['loss']), 'grad_norm': list(self.history['grad_norm']),
                'skipped': self.skipped}

    def load_state_dict(self, state):
        for name in self.history:
            self.history[name] = [float(v) for v in state.get(name, [])][-self.window:]
        self.skipped = int(state.get('skipped', 0))


class Spike:
    """
    A step the SpikeGuard refused: {name: (value, z, running mean)} and the names that were too
    high.
    """

    def __init__(self, stats, outliers, limits):
        self.stats = stats
        self.outliers = outliers
        self.limits = limits

    def describe(self):
        """
        'loss 4.1234 is 6.2 standard deviations above its running mean 3.1000 (skip_loss_z=5.0)',
        ...
        """
        words = {'loss': ('loss', 'skip_loss_z'), 'grad_norm': ('grad norm', 'skip_grad_z')}
        parts = []
        for name in self.outliers:
            value, z, mean = self.stats[name]
            label, setting = words[name]
            parts.append(
                f"{label} {value:.4f} is {z:.1f} standard deviations above its running mean {mean:.4f} "
                f"({setting}={self.limits[name]})")
        return '; '.join(parts)

    def record(self, iter_num):
        """ The metrics record of the skip. """
        (loss, loss_z, _) = self.stats['loss']
        (grad_norm, grad_z, _) = self.stats['grad_norm']
        return {
            'type': 'skip',
            'iter': iter_num,
            'loss': loss,
            'grad_norm': grad_norm,
            'loss_z': loss_z,
            'grad_z': grad_z
        }
