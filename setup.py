"""Build of the memlord._core C extension.

The CUDA driver API is loaded at run time with dlopen; cuda.h is only used
for its declarations when a CUDA toolkit is found at build time.
"""

import os
import sys

import numpy
from setuptools import Extension, setup

SOURCES = sorted(os.path.join("src", f) for f in os.listdir("src") if f.endswith(".c"))
HEADERS = sorted(os.path.join("src", f) for f in os.listdir("src") if f.endswith(".h"))

define_macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
include_dirs = ["src", numpy.get_include()]
for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
    if root and os.path.exists(os.path.join(root, "include", "cuda.h")):
        define_macros.append(("MEMLORD_HAVE_CUDA_H", "1"))
        include_dirs.append(os.path.join(root, "include"))
        break

extra_compile_args = [
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Wno-missing-field-initializers",
    # only PyInit__core is exported: calls between the files are direct, not through the PLT
    "-fvisibility=hidden",
]
extra_link_args = []
# Link-time optimisation inlines the small ledger, site and metadata helpers into the hooks
# across files (a few percent of a hooked conversion).  MEMLORD_NO_LTO=1 builds without it.
if (
    sys.platform.startswith("linux")
    and not os.environ.get("MEMLORD_NO_LTO")
    and not os.environ.get("MEMLORD_SANITIZE")
):
    extra_compile_args.append("-flto=auto")
    extra_link_args.append("-flto=auto")
if os.environ.get("MEMLORD_SANITIZE"):
    flags = [
        "-fsanitize=address,undefined",
        "-fno-omit-frame-pointer",
        "-fno-sanitize-recover=undefined",
        "-O1",
        "-g",
        "-DML_NO_FREELIST",  # pooled memory would hide a use after free
    ]
    extra_compile_args += flags
    extra_link_args += flags
if os.environ.get("MEMLORD_WERROR"):
    extra_compile_args.append("-Werror")
libraries = [] if sys.platform == "win32" else ["dl"]

setup(
    ext_modules=[
        Extension(
            "memlord._core",
            sources=SOURCES,
            depends=HEADERS,  # a header change rebuilds
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            libraries=libraries,
        )
    ]
)
