"""The performance meters: rates of the model, its feeding, search, pixel decoding and training source on this machine
(roofline, feeding, search_batch, pixel_throughput, train_source) and the GPU run's steps and device set-up
(gpu_pipelines, gpu_device)."""
