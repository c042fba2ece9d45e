"""
Device, dtype, autocast and torch.distributed set-up shared by every entry point, plus the one way
scripts turn user errors into a single clear line.

Usage:
    from nanogpt_plus.runtime import init_distributed, precision, run_main
    dist_info = init_distributed(device='auto', backend='auto')   # torchrun or a single process
    dtype, ctx = precision(dist_info.device, 'auto')   # TF32 on CUDA, dtype, autocast context
"""

import os
import subprocess
import sys
import traceback
from contextlib import nullcontext
from dataclasses import dataclass

import torch

PTDTYPE = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


class UserError(Exception):
    """ Something the user can fix (missing data, bad checkpoint, bad option); the message says how. """


# the exit code of a run stopped cleanly by SIGTERM/SIGINT after saving its checkpoint: sysexits.h's
# EX_TEMPFAIL ("temporary failure, retry"), so a scheduler can tell "interrupted, resume me" from done (0),
# a user error (2), a crash (1) and a second Ctrl-C (130)
EXIT_INTERRUPTED = 75


class Interrupted(Exception):
    """ A signal stopped the run and its state is saved; run_main exits EXIT_INTERRUPTED without a traceback. """


class PeerFailed(Exception):
    """
    Rank 0 failed at something all ranks depend on (a checkpoint it alone writes) and prints why itself; the
    other ranks raise this to stop with the same exit code without printing the message a second time.
    """

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def error_line(error, limit=200):
    """ 'Type: the first line of its message' (cut to limit characters), for an error quoted inside ours. """
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:limit]}" if lines else type(error).__name__


def run_main(main):
    """
    Run a script's main(): errors the user can fix print as one line ('error: ...') and exit code 2; a clean
    stop after a signal (Interrupted) exits EXIT_INTERRUPTED (75), a second Ctrl-C 130.
    Under torchrun a failing rank exits at once (os._exit, no interpreter shutdown), so it never waits in
    teardown while its peers sit in a collective: they see it gone (gloo: 'Connection closed by peer') or
    torchrun stops them, and the whole job ends with the one message of the rank that failed.
    """
    try:
        main()
    except (PeerFailed, Interrupted) as e:  # said already: by rank 0, or the script's how-to-resume line
        _exit(exit_code(e))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _exit(130)
    except Exception as e:
        if exit_code(e) == 2:  # UserError, ConfigError, TokenizerError: the user's to fix, in one line
            print(f"error: {e}", file=sys.stderr)
            _exit(2)
        if not _several_processes():
            raise
        if lost_peer(e):  # a consequence, not the cause: the rank that failed has printed the cause
            print(f"rank {os.environ.get('RANK')}: stopping without saving, another process of this run is "
                  f"gone ({error_line(e)})", file=sys.stderr)
        else:
            traceback.print_exc()
        _exit(1)


def _several_processes():
    return int(os.environ.get('WORLD_SIZE', '1')) > 1  # torchrun's workers (the process group may be gone)


def _exit(code):
    if not _several_processes():
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def lost_peer(error):
    """ Whether error is a collective failing because another rank is gone (gloo) or unreachable (nccl). """
    import torch.distributed as dist
    if isinstance(error, dist.DistError):  # DistBackendError (nccl errors, timeouts), DistNetworkError, ...
        return True
    # gloo raises a plain RuntimeError when the peer's socket closes
    return isinstance(error, RuntimeError) and any(
        s in str(error) for s in ('Connection closed by peer', 'Connection reset by peer', 'Broken pipe'))


def exit_code(error):
    """ The exit code run_main ends with for error, so the ranks that didn't raise it can end alike. """
    from configurator import ConfigError
    from nanogpt_plus.tokenizer import TokenizerError
    if isinstance(error, PeerFailed):
        return error.code
    if isinstance(error, Interrupted):
        return EXIT_INTERRUPTED
    if isinstance(error, (UserError, ConfigError, TokenizerError)):
        return 2
    return 130 if isinstance(error, KeyboardInterrupt) else 1


def master_decides(dist_info, fn):
    """
    Run fn() on rank 0 only (writing a checkpoint, say) and let every rank end the same way: when it raises,
    rank 0 raises the error and the others PeerFailed, instead of walking on into the next collective that
    rank 0 will never join. Costs one broadcast (with several processes).
    """
    error = None
    if dist_info.master:
        try:
            fn()
        except BaseException as e:  # every kind, a second Ctrl-C too: the other ranks must hear of it first
            error = e
    outcome = None if error is None else exit_code(error)
    if dist_info.ddp:
        import torch.distributed as dist
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if error is not None:
        raise error
    if outcome is not None:
        raise PeerFailed("rank 0 failed", outcome)


def fail_everywhere(error, dist_info):
    """ Raise a UserError that every rank has decided on alike: rank 0 reports it, the others stop quietly. """
    if dist_info.master:
        raise error
    raise PeerFailed(str(error), 2)


def resolve_device(device='auto'):
    """ 'auto' -> cuda, else mps, else cpu; validates explicit choices ('cpu', 'cuda', 'cuda:N', 'mps'). """
    if device == 'auto':
        if torch.cuda.is_available():
            return 'cuda'
        if getattr(torch.backends, 'mps', None) is not None and torch.backends.mps.is_available():
            return 'mps'
        return 'cpu'
    kind, _, index = device.partition(':')
    if kind not in ('cpu', 'cuda', 'mps') or (index and not index.isdigit()) or (index and kind != 'cuda'):
        raise UserError(f"unknown device '{device}': use auto, cpu, cuda, cuda:N or mps")
    if kind == 'cuda':
        if not torch.cuda.is_available():
            raise UserError(f"device '{device}' was asked for but CUDA is not available; use --device=cpu (or auto)")
        if index and int(index) >= torch.cuda.device_count():
            raise UserError(f"device '{device}' does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    if kind == 'mps' and not (getattr(torch.backends, 'mps', None) and torch.backends.mps.is_available()):
        raise UserError("device 'mps' was asked for but MPS is not available; use --device=cpu (or auto)")
    return device


def device_type_of(device):
    return 'cuda' if 'cuda' in str(device) else ('mps' if 'mps' in str(device) else 'cpu')


def resolve_dtype(dtype, device):
    """ 'auto' -> bfloat16 on GPUs with native bf16, float16 on other GPUs, float32 elsewhere. """
    device_type = device_type_of(device)
    if dtype == 'auto':
        if device_type == 'cuda':
            # by default is_bf16_supported() also says yes where bf16 is only emulated (V100, T4: no bf16
            # tensor cores), which runs far slower than fp16 with a GradScaler; count native support only
            return 'bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16'
        return 'float32'
    if dtype not in PTDTYPE:
        raise UserError(f"unknown dtype '{dtype}': use auto, float32, bfloat16 or float16")
    if dtype == 'float16' and device_type == 'cpu':
        raise UserError("float16 training is not supported on CPU; use --dtype=bfloat16 or float32")
    return dtype


def autocast_context(device, dtype):
    """ Mixed precision for the forward pass; float32 (and so the CPU default) runs without autocast. """
    device_type = device_type_of(device)
    if dtype == 'float32':
        return nullcontext()
    return torch.amp.autocast(device_type=device_type, dtype=PTDTYPE[dtype])


def enable_tf32():
    """ float32 matmuls and convolutions on CUDA may use TF32 tensor cores (10-bit mantissa inputs, fp32 sums). """
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def precision(device, dtype):
    """ The numerics of a run on device: TF32 on CUDA, dtype ('auto' resolved) and its autocast context. """
    if device_type_of(device) == 'cuda':
        enable_tf32()
    dtype = resolve_dtype(dtype, device)
    return dtype, autocast_context(device, dtype)


@dataclass
class DistInfo:
    ddp: bool
    rank: int
    local_rank: int
    world_size: int
    device: str

    @property
    def master(self):
        return self.rank == 0  # rank 0 is the process that logs and writes the checkpoints


def init_distributed(device='auto', backend='auto'):
    """
    Under torchrun (RANK in the environment) join the process group: nccl for CUDA, gloo for CPU, each
    CUDA rank on cuda:LOCAL_RANK. Otherwise a single process on the resolved device.
    """
    import torch.distributed as dist
    device = resolve_device(device)
    if int(os.environ.get('RANK', -1)) == -1:
        return DistInfo(False, 0, 0, 1, device)
    rank, local_rank = int(os.environ['RANK']), int(os.environ['LOCAL_RANK'])
    world_size = int(os.environ['WORLD_SIZE'])
    device_type = device_type_of(device)
    if device_type == 'cuda':
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    elif device_type == 'mps':
        raise UserError("distributed training on MPS is not supported; use --device=cpu or a CUDA machine")
    if backend == 'auto':
        backend = 'nccl' if device_type == 'cuda' else 'gloo'
    if not dist.is_initialized():
        kwargs = dict(device_id=torch.device(device)) if backend == 'nccl' else {}
        dist.init_process_group(backend=backend, **kwargs)
    return DistInfo(True, rank, local_rank, world_size, device)


def destroy_distributed():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def git_commit():
    """ The current git commit of this checkout (with '+dirty' when modified), or 'unknown'. """
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=here, capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return 'unknown'
    return (commit + ('+dirty' if dirty else '')) if commit else 'unknown'


def provenance(device):
    """ What produced a run: versions, commit and device, printed at start-up and kept in checkpoints. """
    info = {'torch': str(torch.__version__), 'python': sys.version.split()[0], 'git_commit': git_commit(),
            'device': str(device), 'num_threads': torch.get_num_threads()}
    if device_type_of(device) == 'cuda':
        info['gpu'] = torch.cuda.get_device_name(torch.device(device))
    return info
