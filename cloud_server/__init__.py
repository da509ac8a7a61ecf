"""EdgeSplit cloud server: coordinator, server side of each method, reports."""
