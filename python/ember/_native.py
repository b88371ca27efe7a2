"""Loading libember.so and declaring its C functions (capi/ember.h) for ctypes.

The library is found, in order:
  1. the EMBER_LIB environment variable (a path to libember.so[.0]);
  2. a build tree of this checkout: <repo>/build/<dir>/capi/libember.so.0,
     preferring the "release" then "dev" presets, else the newest one;
  3. the dynamic linker's search path (an installed libember.so.0).
If none works, ImportError says what was tried and how to build it.

ctypes releases the GIL around every call into the library, so a blocking
call (a pull, a barrier, a wait) lets other Python threads run.
"""

import ctypes
import glob
import os

ABI_VERSION = 0
_SONAME = "libember.so.%d" % ABI_VERSION
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Status codes: ember.h's EMBER_* (== ember::ErrorCode's numbers).
PENDING = -1
OK = 0
E_INVALID_ARGUMENT = 1
E_CONFIG = 2
E_POOL_EXHAUSTED = 3
E_TOO_LARGE = 4
E_MALFORMED_FRAME = 5
E_CHECKSUM_MISMATCH = 6
E_IO = 7
E_CLOSED = 8
E_TIMEOUT = 9
E_NOT_FOUND = 10
E_SHAPE_MISMATCH = 11
E_PROTOCOL = 12
E_AUTH = 13
E_VERSION_MISMATCH = 14
E_UNAVAILABLE = 15
E_WORKER_LOST = 16
E_STALE = 17
E_CANCELLED = 18
E_INTERNAL = 19
E_CORRUPT = 20
E_OUT_OF_STEP = 21  # the step does not follow the server's; Worker.step(key) is now the server's

RANK_FROM_CONFIG = -1
WAIT_FOREVER = -1


def _candidates():
    """Paths to try, in order, with where each came from."""
    env = os.environ.get("EMBER_LIB")
    if env:
        return [(env, "EMBER_LIB")]
    out = []
    build = os.path.join(_REPO, "build")
    for preset in ("release", "dev"):
        p = os.path.join(build, preset, "capi", _SONAME)
        if os.path.exists(p):
            out.append((p, "build tree"))
    others = [p for p in glob.glob(os.path.join(build, "*", "capi", _SONAME))
              if all(p != q for q, _ in out)]
    others.sort(key=os.path.getmtime, reverse=True)
    out.extend((p, "build tree") for p in others)
    out.append((_SONAME, "system library path"))
    return out


def _load():
    tried = []
    for path, origin in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            tried.append("%s (%s): %s" % (path, origin, e))
            if origin == "EMBER_LIB":
                break  # an explicit choice that fails is not silently replaced
    raise ImportError(
        "ember: cannot load libember.so. Tried:\n  " + "\n  ".join(tried) +
        "\nBuild it in this checkout with the preset you use (found there as "
        "build/<preset>/capi/%s):\n"
        "  cmake --preset release && cmake --build build/release --target ember_capi\n"
        "  cmake --preset dev && cmake --build build/dev --target ember_capi\n"
        "or set EMBER_LIB to the path of %s." % (_SONAME, _SONAME))


lib = _load()

_c_worker_p = ctypes.c_void_p
_c_request_p = ctypes.c_void_p
_c_pipeline_p = ctypes.c_void_p
_u64p = ctypes.POINTER(ctypes.c_uint64)
_u32p = ctypes.POINTER(ctypes.c_uint32)
_f32p = ctypes.c_void_p  # float* passed as an address (numpy arrays give integers)

_PROTOTYPES = {
    "ember_version": (ctypes.c_char_p, []),
    "ember_abi_version": (ctypes.c_int, []),
    "ember_error_name": (ctypes.c_char_p, [ctypes.c_int]),
    "ember_last_error": (ctypes.c_char_p, []),
    "ember_last_error_code": (ctypes.c_int, []),
    "ember_set_log_level": (ctypes.c_int, [ctypes.c_char_p]),
    "ember_worker_create": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int64,
                                           ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t,
                                           ctypes.POINTER(_c_worker_p)]),
    "ember_worker_destroy": (None, [_c_worker_p]),
    "ember_worker_info": (ctypes.c_int, [_c_worker_p, _u32p, _u32p, _u32p]),
    "ember_step": (ctypes.c_int, [_c_worker_p, ctypes.c_uint64, _u64p]),
    "ember_alloc": (ctypes.c_int, [_c_worker_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]),
    "ember_free": (ctypes.c_int, [_c_worker_p, ctypes.c_void_p]),
    "ember_buffer_info": (ctypes.c_int, [_c_worker_p, ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_size_t),
                                         ctypes.POINTER(ctypes.c_int)]),
    "ember_init": (ctypes.c_int, [_c_worker_p, ctypes.c_uint64, _u64p, ctypes.c_size_t,
                                  _f32p, ctypes.c_size_t, _u64p]),
    "ember_push": (ctypes.c_int, [_c_worker_p, ctypes.c_uint64, _f32p, ctypes.c_size_t, _u64p]),
    "ember_pull": (ctypes.c_int, [_c_worker_p, ctypes.c_uint64, _f32p, ctypes.c_size_t, _u64p]),
    "ember_push_pull": (ctypes.c_int, [_c_worker_p, ctypes.c_uint64, _f32p, _f32p,
                                       ctypes.c_size_t, _u64p]),
    "ember_push_async": (ctypes.c_int, [_c_worker_p, ctypes.c_uint64, _f32p, ctypes.c_size_t,
                                        ctypes.POINTER(_c_request_p)]),
    "ember_pull_async": (ctypes.c_int, [_c_worker_p, ctypes.c_uint64, _f32p, ctypes.c_size_t,
                                        ctypes.POINTER(_c_request_p)]),
    "ember_push_pull_async": (ctypes.c_int, [_c_worker_p, ctypes.c_uint64, _f32p, _f32p,
                                             ctypes.c_size_t, ctypes.POINTER(_c_request_p)]),
    "ember_barrier": (ctypes.c_int, [_c_worker_p, _u64p]),
    "ember_set_learning_rate": (ctypes.c_int, [_c_worker_p, ctypes.c_double]),
    "ember_checkpoint": (ctypes.c_int, [_c_worker_p, _u64p]),
    "ember_wait": (ctypes.c_int, [_c_request_p, ctypes.c_int64, _u64p]),
    "ember_request_free": (None, [_c_request_p]),
    "ember_pipeline_create": (ctypes.c_int, [_c_worker_p, ctypes.POINTER(_c_pipeline_p)]),
    "ember_pipeline_push": (ctypes.c_int, [_c_pipeline_p, ctypes.c_uint64, _f32p,
                                           ctypes.c_size_t, ctypes.POINTER(_c_request_p)]),
    "ember_pipeline_pull": (ctypes.c_int, [_c_pipeline_p, ctypes.c_uint64, _f32p,
                                           ctypes.c_size_t, ctypes.POINTER(_c_request_p)]),
    "ember_pipeline_push_pull": (ctypes.c_int, [_c_pipeline_p, ctypes.c_uint64, _f32p, _f32p,
                                                ctypes.c_size_t, ctypes.POINTER(_c_request_p)]),
    "ember_pipeline_flush": (ctypes.c_int, [_c_pipeline_p]),
    "ember_pipeline_wait": (ctypes.c_int, [_c_pipeline_p]),
    "ember_pipeline_destroy": (None, [_c_pipeline_p]),
}

for _name, (_restype, _argtypes) in _PROTOTYPES.items():
    _fn = getattr(lib, _name)
    _fn.restype = _restype
    _fn.argtypes = _argtypes

if lib.ember_abi_version() != ABI_VERSION:
    raise ImportError("ember: %s has ABI version %d, this package needs %d"
                      % (getattr(lib, "_name", "libember"), lib.ember_abi_version(), ABI_VERSION))


def error_name(code):
    """Stable short name of a status code ("not_found", "timeout", ...)."""
    return lib.ember_error_name(int(code)).decode()


def last_error():
    """This thread's last error text from the library ("" after a success)."""
    return lib.ember_last_error().decode("utf-8", "replace")
