"""Prints what CMake needs to build C++ code against the torch this Python imports, one ``key=value``
a line (cmake/torch_ops.cmake reads them): its version, C++ ABI, whether it was built with CUDA,
and its header and library directories (those torch.utils.cpp_extension.include_paths() and
library_paths() give, found without importing cpp_extension, which needs setuptools)."""

import os

import torch

root = os.path.dirname(os.path.abspath(torch.__file__))
print(f"version={torch.__version__}")
print(f"cxx11_abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
print(f"cuda={int(torch.version.cuda is not None)}")
print(f"include_dirs={os.path.join(root, 'include')};"
      f"{os.path.join(root, 'include', 'torch', 'csrc', 'api', 'include')}")
print(f"library_dir={os.path.join(root, 'lib')}")
