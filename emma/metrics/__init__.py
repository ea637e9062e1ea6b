"""Metrics of a cell (definitions: docs/metrics.md)."""

#: version of each metric family, recorded in results.json (``versions.metrics``); bumped,
#: with a CHANGELOG entry, whenever a definition or an interval changes
METRIC_VERSIONS: dict[str, str] = {
    "rates": "2",  # ASR per attacked prompt; Wilson / cluster-bootstrap intervals; exclusions
    "timing": "2",  # stored with images, replayed; warm-up excluded; interval over batches
    "fid": "2",  # suite-mix tiny-world reference; cluster-bootstrap interval; reference recorded
    "bias": "2",  # paired (same-seed) reading by default; paired cluster bootstrap
}
