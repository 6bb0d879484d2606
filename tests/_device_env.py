"""Work-arounds for the GPU machine's software, for the ``gpu`` tests' worker processes."""


def pickleable_month_day_nano() -> None:
    """The GPU machine's python 3.12 with pyarrow 25/26 gives the (immutable) ``pyarrow.MonthDayNano`` type the
    module ``builtins``, so pickle cannot find it, datasets cannot hash a Dataset's state and ``Dataset.from_dict``
    fails there; this child process makes the name resolve (datasets only hashes the pickle, never loads it)."""
    import builtins
    import pickle

    import pyarrow

    try:
        pickle.dumps(pyarrow.MonthDayNano)
    except pickle.PicklingError:
        builtins.MonthDayNano = pyarrow.MonthDayNano
