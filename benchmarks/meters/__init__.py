"""The performance meters: rates of the model, its feeding, search and pixel decoding on this machine (roofline,
feeding, search_batch, pixel_throughput) and the GPU run's steps and device set-up (gpu_pipelines, gpu_device)."""
