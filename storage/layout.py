"""The layout a shard records for itself, and the check of it against the manifest.

Every shard written now carries its layout (a Zarr group's `layout` attribute, a tar's first
member `__layout__.json`): format and format version, feature codecs, `ira_parents`, the array
groups, the compute dtype the target ran in, and each array's dtype and row shape. A reader opens
a shard and compares this with what the manifest says before it reads a row, so a shard copied in
from another cache or a build with other settings is refused in one line instead of training on
rows laid out otherwise. A shard written before layouts were recorded has none and is checked
against the manifest as before (sizes and rows at open, everything by `verify`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from storage.format import array_codecs, format_version_for, record_array_names
from storage.records import RecordDims, record_dtype, record_shapes

if TYPE_CHECKING:
    from storage.manifest import Manifest

# The order a mismatch is reported in: the first differing field names the cause.
LAYOUT_FIELDS = (
    "format", "feature_codec", "rollout_feature_codec", "ira_parents", "contents", "compute", "arrays", "format_version",
)  # fmt: skip
REBUILD_HINT = "it comes from another cache or a build with other settings: rerun the cache build to rebuild it"


def shard_layout(
    *, storage_format: str, feature_codec: str, rollout_feature_codec: str | None, contents, ira_parents: int | None,
    compute: dict[str, str] | None, feature_dim: int, top_k: int | None, num_slots: int | None,
) -> dict:  # fmt: skip
    """The layout record of a shard with these settings whose records have these F, k and K."""
    dims = RecordDims(num_tokens=1, num_anchors=1, feature_dim=feature_dim, top_k=top_k, num_slots=num_slots, num_parents=1)
    shapes = record_shapes(dims, feature_codec=feature_codec, contents=contents, rollout_feature_codec=rollout_feature_codec)
    arrays = {}
    for name in record_array_names(feature_codec, contents, rollout_feature_codec):
        if name == "source_row":
            continue
        dtype = record_dtype(name, feature_codec=feature_codec, rollout_feature_codec=rollout_feature_codec)
        arrays[name] = {"dtype": dtype.str, "row_shape": list(shapes[name][1:])}
    return {
        "format": storage_format,
        "format_version": format_version_for(
            ira_parents=ira_parents, feature_codec=feature_codec, rollout_feature_codec=rollout_feature_codec
        ),
        "feature_codec": feature_codec,
        "rollout_feature_codec": array_codecs(feature_codec, rollout_feature_codec)["rollout_features"],
        "ira_parents": ira_parents,
        "contents": sorted(contents),
        "compute": compute,
        "arrays": arrays,
    }


def expected_layout(manifest: Manifest) -> dict:
    """The layout every shard of the cache `manifest` describes must record."""
    settings = manifest.settings
    layout = shard_layout(
        storage_format=settings.storage_format, feature_codec=settings.feature_codec,
        rollout_feature_codec=settings.rollout_feature_codec, contents=settings.contents, ira_parents=settings.ira_parents,
        compute=manifest.compute, feature_dim=manifest.feature_dim, top_k=settings.top_k, num_slots=settings.num_slots,
    )  # fmt: skip
    layout["format_version"] = manifest.format_version or settings.format_version
    return layout


def layout_problem(found: dict | None, expected: dict, *, where: str) -> str | None:
    """One line naming the first field where a shard's recorded layout `found` differs from the
    manifest's `expected`; None when they agree or the shard records none (written before
    layouts were). Only the fields `found` holds are compared (a format may vouch for part of
    an older shard's layout from its own metadata); a compute dtype either side does not record
    is not compared."""
    if found is None:
        return None
    if not isinstance(found, dict):
        return f"{where}: its layout record is not a mapping ({type(found).__name__}); {REBUILD_HINT}"
    names = found.get("array_names")  # an older tar's: only which arrays its first sample holds
    if names is not None and sorted(names) != sorted(expected["arrays"]):
        name = sorted(set(names) ^ set(expected["arrays"]))[0]
        where_not = "the shard" if name in expected["arrays"] else "this cache's manifest"
        return f"{where}: array {name} is absent in {where_not}; {REBUILD_HINT}"
    for field in LAYOUT_FIELDS:
        if field not in found:
            continue
        got, want = found[field], expected.get(field)
        if field == "compute" and (got is None or want is None):
            continue
        if field == "arrays" and isinstance(got, dict) and isinstance(want, dict) and got != want:
            name = next(n for n in sorted(set(got) | set(want)) if got.get(n) != want.get(n))
            return (
                f"{where}: array {name} is {_array(got.get(name))} in the shard, {_array(want.get(name))} in this cache's "
                f"manifest; {REBUILD_HINT}"
            )
        if got != want:
            return f"{where}: written with {field} {got!r}, this cache's manifest says {want!r}; {REBUILD_HINT}"
    return None


def _array(spec: dict | None) -> str:
    if spec is None:
        return "absent"
    return f"{spec.get('dtype')} rows of shape {tuple(spec.get('row_shape') or ())}"
