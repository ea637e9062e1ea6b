"""Metrics of a cell (definitions: docs/metrics.md)."""

#: version of each metric family, recorded in results.json (``versions.metrics``); bumped,
#: with a CHANGELOG entry, whenever a definition or an interval changes
METRIC_VERSIONS: dict[str, str] = {
    # rates 4: beta-binomial profile interval for image rates, ea and ra over all types;
    # 3: asr/pre under the attack's protocol, attack/judged_queries_mean; 2: ASR per prompt
    "rates": "4",
    "timing": "3",  # stored with images, replayed; warm-up excluded; interval over batches, says what it covers
    "fid": "2",  # suite-mix tiny-world reference; cluster-bootstrap interval; reference recorded
    "bias": "3",  # 3: seeds derived per prompt index (emma.seeds); 2: paired reading, paired bootstrap
}
