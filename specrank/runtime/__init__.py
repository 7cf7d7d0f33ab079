"""How work runs: Ray/job sharding, memory, the numba cache, the interpreter, fault points."""
