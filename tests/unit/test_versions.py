"""Recording package versions never raises: a source checkout (not installed) records None."""

from importlib.metadata import version

from ascender_dist.versions import package_version, package_versions


def test_installed_package_reports_its_metadata_version():
    assert package_version("torch") == version("torch")


def test_missing_package_is_none_not_an_error():
    assert package_version("surely-not-an-installed-package-4d1f") is None


def test_versions_keep_the_order_asked_for():
    got = package_versions(["surely-not-an-installed-package-4d1f", "pyyaml"])
    assert list(got) == ["surely-not-an-installed-package-4d1f", "pyyaml"]
    assert got["surely-not-an-installed-package-4d1f"] is None and got["pyyaml"] == version("pyyaml")
