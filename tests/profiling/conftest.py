"""calibrate's, profile_model's and aceso profile's host probe reads the real host; tests that fake the runs fake the probe too, as an
idle host, so they never depend on what else the machine is doing."""
import pytest


@pytest.fixture(autouse=True)
def idle_host_probe(monkeypatch):
    from megatron.aceso import __main__ as aceso_main
    from megatron.profiling import calibrate, noise, profile_model
    idle = noise.HostNoise(share=1.0, clean=0.9, samples=400, seconds=2.0, load=0.5)
    monkeypatch.setattr(calibrate, "probe_host", lambda: idle)
    monkeypatch.setattr(profile_model, "probe_host", lambda: idle)
    monkeypatch.setattr(aceso_main, "probe_host", lambda: idle)
    return idle
