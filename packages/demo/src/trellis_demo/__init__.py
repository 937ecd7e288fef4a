"""trellis-demo: a tiny model learns arithmetic on a CPU (``trellis demo``), and the tiny local models and tasks tests and benches are built on."""
