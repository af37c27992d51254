"""Bulk jobs over a corpus: `synapse batch embed` on this machine (`batch.job`) or on Ray
Data (`batch.ray_job`). Same rows rules (`batch.rows`), same output (`batch.output`)."""
