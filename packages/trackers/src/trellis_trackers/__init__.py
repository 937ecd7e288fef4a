"""trellis-trackers: a run's metrics in TensorBoard, Weights & Biases or MLflow (``trainer.trackers``)."""
