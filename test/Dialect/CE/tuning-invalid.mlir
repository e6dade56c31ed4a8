// RUN: ce-opt %s -split-input-file -verify-diagnostics

// Kernel tuning is one typed, verified attribute: a misspelt attribute, a
// misspelt field or a value out of range is an error, never a default.

// expected-error @+1 {{'ce.block_size' is not an attribute of the ce dialect (kernel tuning is 'ce.tuning = #ce.tuning<...>')}}
func.func @loose_attribute() attributes {ce.block_size = 256 : i64} {
  return
}

// -----

// expected-error @+1 {{'ce.tuning' must be a #ce.tuning<...>, got 256 : i64}}
func.func @wrong_kind() attributes {ce.tuning = 256 : i64} {
  return
}

// -----

// expected-error @+1 {{'ce.tuning' belongs on a kernel function}}
module attributes {ce.tuning = #ce.tuning<block_size = 64, unroll = 2>} {
}

// -----

// expected-error @+1 {{tuning unroll 0 is outside [1, 16]}}
func.func @bad_unroll() attributes {ce.tuning = #ce.tuning<block_size = 64, unroll = 0>} {
  return
}

// -----

// expected-error @+1 {{tuning block_size 2048 is outside [1, 1024]}}
func.func @bad_block() attributes {ce.tuning = #ce.tuning<block_size = 2048, unroll = 2>} {
  return
}

// -----

// expected-error @+1 {{tuning stream_stages 1 must be 0 (off) or in [2, 8]}}
func.func @bad_stages() attributes {ce.tuning = #ce.tuning<block_size = 64, unroll = 2, stream_stages = 1>} {
  return
}

// -----

// expected-error @+1 {{struct is missing required parameter: unroll}}
func.func @missing_field() attributes {ce.tuning = #ce.tuning<block_size = 64>} {
  return
}

// -----

// expected-error @+1 {{duplicate or unknown struct parameter name: block_sise}}
func.func @misspelt_field() attributes {ce.tuning = #ce.tuning<block_sise = 64, unroll = 2>} {
  return
}
