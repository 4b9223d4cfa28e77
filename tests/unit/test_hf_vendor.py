"""The layer math copied into Hugging Face remote-code exports (hf/vendor.py), without an export:
every module the model needs reaches the copy with flat relative imports, the copies import in a
fresh interpreter that cannot import ascender_dist, and an import the copy cannot follow is one
line naming the module and line."""

import subprocess
import sys

import pytest

from ascender_dist.hf.vendor import VendorError, rewrite_module, vendor_kernels


def test_every_kernel_module_vendors_and_imports_without_ascender_dist(tmp_path):
    written = vendor_kernels(tmp_path)
    assert "ascender_dist_kernels.py" in written
    assert any(name.startswith("asd_ascender_kernels_") for name in written)  # the Triton modules travel
    (tmp_path / "__init__.py").write_text("")
    probe = ("import sys, importlib.abc\n"
             "class Block(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path, target=None):\n"
             "        if name.split('.')[0] == 'ascender_dist': raise ImportError('ascender_dist blocked')\n"
             "sys.meta_path.insert(0, Block())\n"
             f"sys.path.insert(0, {str(tmp_path.parent)!r})\n"
             f"m = __import__({tmp_path.name!r} + '.ascender_dist_kernels', fromlist=['x'])\n"
             "print(sorted(m.__all__))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ascender_attention" in out.stdout


@pytest.mark.parametrize("line", ["from .. import fast_moments", "import ascender_dist.models",
                                  "from ascender_dist.training import trainer"])
def test_an_import_the_copy_cannot_follow_is_one_line_naming_it(line):
    with pytest.raises(VendorError, match=r"^ascender_dist\.models\.ascender\.kernels\.function:2: .*cannot be vendored"):
        rewrite_module(f"import torch\n{line}\n", "ascender_kernels", "ascender_dist.models.ascender.kernels.function")
