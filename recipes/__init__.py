from specrank.runtime.interpreter import use_project_interpreter

use_project_interpreter()  # a `python -m` command outside .venv reruns in it (specrank.runtime.interpreter)
