"""Recording the calls of a module's functions inside a test (child processes included, where pytest's monkeypatch
fixture is not at hand)."""

from contextlib import contextmanager


@contextmanager
def recorded_calls(module, *names):
    """While inside, each call of ``module.<name>`` runs as before and is recorded: yields ``{name: [shape of the
    call's first argument, ...]}``; the functions are put back on leaving."""
    calls = {name: [] for name in names}
    real = {name: getattr(module, name) for name in names}

    def spy(name):
        def call(*args, **kwargs):
            calls[name].append(tuple(args[0].shape))
            return real[name](*args, **kwargs)
        return call

    for name in names:
        setattr(module, name, spy(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(module, name, fn)
