"""A corpus of small reproductions of real NaN/Inf bugs, and the runner that records them."""
