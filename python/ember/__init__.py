"""Ember: a parameter server for data-parallel training — the Python worker.

    import ember, numpy as np

    with ember.Worker("config/ember.toml", rank=0) as w:
        params = w.allocate((784, 10))           # zero-copy view of a pool buffer
        w.init(1, values=initial_params)         # rank 0 gives the initial values
        grad = w.allocate((784, 10))
        ...                                      # compute into grad
        w.push_pull(1, grad, out=params)         # send gradient, receive parameters
        with w.pipeline() as p:                  # many small tensors, batched
            for key, g in grads.items():
                p.enqueue(key, g, out=params_of[key])

A ctypes binding of libember.so (capi/ember.h); see ember.worker for the
contracts (dtypes, lifetime, thread-safety) and ember._native for how the
library is found (EMBER_LIB or the build tree).
"""

from ._native import (  # noqa: F401  (status codes, re-exported)
    ABI_VERSION, OK, PENDING, E_INVALID_ARGUMENT, E_CONFIG, E_POOL_EXHAUSTED, E_TOO_LARGE,
    E_MALFORMED_FRAME, E_CHECKSUM_MISMATCH, E_IO, E_CLOSED, E_TIMEOUT, E_NOT_FOUND,
    E_SHAPE_MISMATCH, E_PROTOCOL, E_AUTH, E_VERSION_MISMATCH, E_UNAVAILABLE, E_WORKER_LOST,
    E_STALE, E_CANCELLED, E_INTERNAL, E_CORRUPT, E_OUT_OF_STEP, error_name)
from .worker import EmberError, Future, Pipeline, Worker, set_log_level, version  # noqa: F401

__version__ = version()
