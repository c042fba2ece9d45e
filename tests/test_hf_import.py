"""
nanogpt_plus/hf_import.py, gpt2* names without a network: the local hub cache is read first, so a cached model loads
offline; with HF_HUB_OFFLINE set nothing reaches for the network; without it, a hub that can't be reached is refused
in one line at once instead of after huggingface_hub's ~25 s of retries; a reachable hub still downloads. The
network is never touched: the probe is patched or points at a closed port of this machine (and huggingface_hub,
imported under conftest's HF_HUB_OFFLINE=1, would refuse a real request anyway).
"""
import json
import os
import socket

import pytest
import torch

from helpers import run_python
from model import GPT, GPTConfig
from nanogpt_plus import hf_import
from nanogpt_plus.errors import UserError
from nanogpt_plus.init_from import init_model

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50, bias=True, gelu='tanh')


SNAPSHOT = 'a' * 40  # the commit a hub cache's refs/main names


def tiny_hf_files(directory):
    """ config.json and model.safetensors of a tiny random GPT-2 in directory; returns it. """
    from safetensors.torch import save_file

    from nanogpt_plus.hf_export import hf_state_dict
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    os.makedirs(directory, exist_ok=True)
    save_file(hf_state_dict(model), os.path.join(directory, 'model.safetensors'))
    config = dict(model_type='gpt2', n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=50)
    with open(os.path.join(directory, 'config.json'), 'w') as f:
        json.dump(config, f)
    return model


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """ An empty hub cache of this test, not the user's (huggingface_hub reads it at call time). """
    import huggingface_hub.constants
    cache = tmp_path / 'hub'
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_CACHE', str(cache))
    return cache


@pytest.fixture
def online(monkeypatch):
    """ HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE unset (conftest sets them for the suite). """
    for key in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE'):
        monkeypatch.delenv(key, raising=False)


def cache_model(cache, name):
    """ A tiny model in the hub cache's layout: models--NAME/refs/main -> snapshots/COMMIT/. """
    repo = cache / f'models--{name}'
    (repo / 'refs').mkdir(parents=True)
    (repo / 'refs' / 'main').write_text(SNAPSHOT)
    return tiny_hf_files(repo / 'snapshots' / SNAPSHOT)


def no_download(monkeypatch):
    """ hf_hub_download allowed to read the cache only; returns the (filename, local_files_only)
    pairs it is asked for. """
    import huggingface_hub
    real, asked = huggingface_hub.hf_hub_download, []

    def cache_only(repo_id, filename, **kwargs):
        asked.append((filename, kwargs.get('local_files_only', False)))
        assert kwargs.get('local_files_only'), f"a download of {filename} was tried"
        return real(repo_id, filename, **kwargs)
    monkeypatch.setattr(huggingface_hub, 'hf_hub_download', cache_only)
    return asked


def no_probe(monkeypatch):
    """ Any connection attempt fails the test. """
    def refuse(*args, **kwargs):
        pytest.fail("the network was reached for")
    monkeypatch.setattr(hf_import.socket, 'create_connection', refuse)


def test_hf_hub_offline_reaches_for_nothing(hub_cache, monkeypatch):
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    asked = no_download(monkeypatch)
    no_probe(monkeypatch)
    monkeypatch.setattr(hf_import, 'hub_unreachable', lambda: pytest.fail("probed when offline"))
    with pytest.raises(UserError) as e:
        init_model('gpt2')
    message = str(e.value)
    assert "\n" not in message and "HF_HUB_OFFLINE is set" in message and "init_from=DIR" in message
    assert asked == [('config.json', True)]


def test_no_network_is_refused_at_once(hub_cache, online, monkeypatch):
    asked = no_download(monkeypatch)
    timeouts = []

    def no_route(address, timeout=None):  # what a machine without a network answers
        timeouts.append(timeout)
        raise socket.gaierror(-2, 'Name or service not known')
    monkeypatch.setattr(hf_import.socket, 'create_connection', no_route)
    with pytest.raises(UserError) as e:
        init_model('gpt2-medium')
    message = str(e.value)
    assert "\n" not in message and "could not download 'gpt2-medium'" in message
    assert "no connection to huggingface.co:443" in message and "init_from=DIR" in message
    # one short attempt, no download after it (huggingface_hub's retries took ~25 s); what it costs
    # is bounded by the timeout asked for, not timed here (no test measures time)
    assert asked == [('config.json', True)] and len(timeouts) == 1 and timeouts[0] <= 5


def closed_port():
    """ A port of this machine nothing listens on: a connection to it is refused at once. """
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_the_probe_connects_to_the_hub_or_its_proxy(monkeypatch):
    import huggingface_hub.constants
    for key in ('https_proxy', 'HTTPS_PROXY', 'all_proxy', 'ALL_PROXY'):
        monkeypatch.delenv(key, raising=False)
    port = closed_port()
    monkeypatch.setattr(huggingface_hub.constants, 'ENDPOINT', f'http://127.0.0.1:{port}')
    assert hf_import.hub_address() == ('127.0.0.1', port)
    assert hf_import.hub_unreachable().startswith(f"offline: no connection to 127.0.0.1:{port}, ")
    # behind a proxy, the proxy is what a download connects to
    monkeypatch.setenv('https_proxy', 'http://proxy.example:3128')
    assert hf_import.hub_address() == ('proxy.example', 3128)
    with socket.socket() as server:  # a listening port: reachable
        server.bind(('127.0.0.1', 0))
        server.listen(1)
        monkeypatch.setenv('https_proxy', f'http://127.0.0.1:{server.getsockname()[1]}')
        assert hf_import.hub_unreachable() is None


@pytest.mark.parametrize('offline', [True, False])
def test_a_cached_model_loads_without_a_network(hub_cache, monkeypatch, offline):
    model = cache_model(hub_cache, 'gpt2')
    if offline:
        monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    else:
        for key in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE'):
            monkeypatch.delenv(key, raising=False)
    asked = no_download(monkeypatch)
    no_probe(monkeypatch)
    loaded, tokenizer_meta, _ = init_model('gpt2')
    assert asked == [('config.json', True), ('model.safetensors', True)]
    assert tokenizer_meta == {'kind': 'gpt2'}
    theirs = loaded.state_dict()
    for name, t in model.state_dict().items():
        torch.testing.assert_close(theirs[name], t, rtol=0, atol=0)
    # FSDP's ranks other than 0: config.json alone, from the cache too
    assert init_model('gpt2', on_meta=True)[0].config == loaded.config


def test_a_reachable_hub_still_downloads(hub_cache, online, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    tiny_hf_files(tmp_path / 'remote')
    asked = []

    def download(repo_id, filename, local_files_only=False, **kwargs):
        asked.append((filename, local_files_only))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        return str(tmp_path / 'remote' / filename)
    monkeypatch.setattr(huggingface_hub, 'hf_hub_download', download)
    monkeypatch.setattr(hf_import, 'hub_unreachable', lambda: None)
    init_model('gpt2-large')
    assert asked == [('config.json', True), ('config.json', False), ('model.safetensors', True),
                     ('pytorch_model.bin', True), ('model.safetensors', False)]


def test_sample_py_refuses_at_once_without_a_network(tmp_path):
    # the whole command, HF_HUB_OFFLINE unset: the hub is a closed port of this machine, no cache
    unset = ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE')
    env = {k: v for k, v in os.environ.items() if k not in unset and not k.lower().endswith('_proxy')}
    env.update(HF_ENDPOINT=f'http://127.0.0.1:{closed_port()}', HF_HUB_CACHE=str(tmp_path / 'hub'))
    r = run_python(['sample.py', '--init_from=gpt2', '--device=cpu'], env=env, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "could not download 'gpt2'" in r.stderr
    assert "Retrying" not in r.stderr, r.stderr  # huggingface_hub's retries: the 25 s it took
