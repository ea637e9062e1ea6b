"""Metrics of a cell (definitions: docs/metrics.md)."""

#: version of each metric family, recorded in results.json (``versions.metrics``); bumped,
#: with a CHANGELOG entry, whenever a definition or an interval changes
METRIC_VERSIONS: dict[str, str] = {
    "rates": "3",  # 3: asr/pre under the attack's protocol; attack/judged_queries_mean (2: ASR per prompt)
    "timing": "2",  # stored with images, replayed; warm-up excluded; interval over batches
    "fid": "2",  # suite-mix tiny-world reference; cluster-bootstrap interval; reference recorded
    "bias": "3",  # 3: seeds derived per prompt index (emma.seeds); 2: paired reading, paired bootstrap
}
