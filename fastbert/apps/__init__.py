"""Applications built on the library: training (train, data), benchmarks (bench) and the demo. The
library (fastbert.*) never imports them; `python -m fastbert` runs them."""


class InputError(ValueError):
    """A problem with a command's input or options, in words, naming the line where there is one: the
    commands print it as one line (exit status 2) where anything else is a bug and keeps its traceback."""
