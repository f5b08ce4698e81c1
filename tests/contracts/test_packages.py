"""Index settings as uv's options and as messages name them."""

from contracts.packages import PackageIndex


def test_an_index_named_in_a_message_never_shows_its_credentials() -> None:
    index = PackageIndex(
        index_url="https://ci:s3cret@mirror.example/simple",
        extra_index_urls=["http://user:pw@extra.example/simple"],
    )
    assert index.describe() == "https://***@mirror.example/simple, http://***@extra.example/simple"
    assert "s3cret" in " ".join(index.uv_args())  # uv itself gets them


def test_a_site_without_an_index_installs_from_its_wheel_folder_only() -> None:
    index = PackageIndex(index_url="", find_links="/srv/wheels")
    assert index.uv_args() == [
        "--no-index",
        "--find-links",
        "/srv/wheels",
        "--only-binary",
        ":all:",
    ]
    assert index.describe() == "wheels in /srv/wheels"
    assert PackageIndex(wheels_only=False).uv_args() == ["--index-url", "https://pypi.org/simple"]
