// RUN: ce-opt %s --ce-expand-exp2 | FileCheck %s

// CHECK-LABEL: func @vector
// CHECK-SAME: %[[X:.*]]: vector<8xf32>
// CHECK-DAG: %[[HI:.*]] = arith.constant dense<1.280000e+02> : vector<8xf32>
// CHECK-DAG: %[[LO:.*]] = arith.constant dense<-1.270000e+02> : vector<8xf32>
// CHECK: %[[MIN:.*]] = arith.minimumf %[[X]], %[[HI]]
// CHECK: %[[CLAMPED:.*]] = arith.maximumf %[[MIN]], %[[LO]]
// CHECK: %[[N:.*]] = math.roundeven %[[CLAMPED]]
// CHECK: %[[F:.*]] = arith.subf %[[CLAMPED]], %[[N]]
// CHECK-COUNT-6: math.fma
// CHECK: arith.fptosi %[[N]] : vector<8xf32> to vector<8xi32>
// CHECK: arith.shli
// CHECK: arith.bitcast {{.*}} : vector<8xi32> to vector<8xf32>
// CHECK: %[[NAN:.*]] = arith.cmpf uno, %[[X]], %[[X]]
// CHECK: arith.select %[[NAN]], %[[X]]
// CHECK-NOT: math.exp2
func.func @vector(%x: vector<8xf32>) -> vector<8xf32> {
  %y = math.exp2 %x : vector<8xf32>
  return %y : vector<8xf32>
}

// CHECK-LABEL: func @scalar
// CHECK: math.roundeven %{{.*}} : f32
// CHECK-NOT: math.exp2
func.func @scalar(%x: f32) -> f32 {
  %y = math.exp2 %x : f32
  return %y : f32
}

// Other element types are left alone.
// CHECK-LABEL: func @f64
// CHECK: math.exp2 %{{.*}} : f64
func.func @f64(%x: f64) -> f64 {
  %y = math.exp2 %x : f64
  return %y : f64
}
