"""Applications built on the library: training (train, data), benchmarks (bench) and the demo. The
library (fastbert.*) never imports them; `python -m fastbert` runs them."""
