from specrank.interpreter import use_project_interpreter
from specrank.omp_wait import passive_openmp_waits

use_project_interpreter()  # a `python -m` command outside .venv reruns in it (specrank.interpreter)
passive_openmp_waits()  # before anything loads libgomp (specrank.omp_wait)
