"""Build of the memlord._core C extension.

The CUDA driver API is loaded at run time with dlopen; cuda.h is only used
for its declarations when a CUDA toolkit is found at build time.
"""

import os
import platform
import sys
import tempfile

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, LinkError

# src/ is in layers, one folder each (docs/architecture.md); includes name the folder
# ("core/event.h") relative to src/, the one include directory.
SOURCES = sorted(
    os.path.join(d, f) for d, _, files in os.walk("src") for f in files if f.endswith(".c")
)
HEADERS = sorted(
    os.path.join(d, f) for d, _, files in os.walk("src") for f in files if f.endswith(".h")
)

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
# across files (a few percent of a hooked conversion).  MEMLORD_NO_LTO=1 builds without it;
# a compiler that rejects the flag builds without it too (see BuildExt).
WANT_LTO = (
    sys.platform.startswith("linux")
    and not os.environ.get("MEMLORD_NO_LTO")
    and not os.environ.get("MEMLORD_SANITIZE")
)

TLS_DESC = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


class BuildExt(build_ext):
    """build_ext that adds link-time optimisation when the compiler accepts it."""

    def _accepts(self, flag: str) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "lto_probe.c")
            with open(src, "w") as f:
                f.write("int memlord_lto_probe(void) { return 0; }\n")
            try:
                objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=[flag])
                self.compiler.link_shared_object(
                    objs, os.path.join(tmp, "probe.so"), extra_postargs=[flag]
                )
            except (CompileError, LinkError):
                return False
        return True

    def build_extensions(self):
        # TLS descriptors: the hooks' per-thread state is read with one indirect call
        # into the dynamic linker's fast path, instead of __tls_get_addr on every hooked
        # call.  Safe for a dlopen'ed module (it falls back to dynamic TLS by itself).
        if TLS_DESC and self._accepts("-mtls-dialect=gnu2"):
            for ext in self.extensions:
                ext.extra_compile_args.append("-mtls-dialect=gnu2")
        if WANT_LTO:
            for flag in ("-flto=auto", "-flto"):
                if self._accepts(flag):
                    for ext in self.extensions:
                        ext.extra_compile_args.append(flag)
                        ext.extra_link_args.append(flag)
                    break
        super().build_extensions()


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
    cmdclass={"build_ext": BuildExt},
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
    ],
)
