// RUN: ce-opt %s --pass-pipeline='builtin.module(gpu.module(ce-map-to-gpu{target=spirv}))' -verify-diagnostics

// expected-error @+1 {{ce-map-to-gpu: unknown target 'spirv' (nvvm or rocdl)}}
gpu.module @kernels {
}
