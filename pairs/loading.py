"""One model load at a time in a process.

transformers' `from_pretrained` swaps `torch.nn.init`'s functions and
`PreTrainedModel.init_weights` for no-ops process-wide while it loads
(`transformers.initialization.no_init_weights`) and then puts back what it found. Two
threads loading at once (two GGUF conversions, Ray actors in one process) can put back the
no-ops, and every model built afterwards would start uninitialized. Every loader of this
package holds `LOADING` around its `from_pretrained` calls (re-entrant: a pair's load may
convert a GGUF file inside it).
"""

from __future__ import annotations

import threading

LOADING = threading.RLock()
