// The fp16 loss scaler (engine/src/loss_scaler.h), without an engine.
#include <gtest/gtest.h>

#include <cmath>

#include "../../engine/src/loss_scaler.h"

namespace tz::detail {
namespace {

PrecisionConfig fp16_dynamic(int power) {
  PrecisionConfig p;
  p.fp16 = true;
  p.loss_scale = 0;
  p.initial_scale_power = power;
  return p;
}

// Every power the config accepts (fp16.initial_scale_power, 0..63) starts the
// scale at exactly 2^power: 63 once wrapped to a negative int64.
TEST(LossScaler, EveryPowerTheConfigAcceptsStartsAtTwoToThePower) {
  for (const std::string& json : {std::string(R"({"fp16": {"enabled": true, "initial_scale_power": 0}})"),
                                  std::string(R"({"fp16": {"enabled": true, "initial_scale_power": 63}})")}) {
    Expected<Config> config = parse_config(json, "test.json");
    ASSERT_TRUE(config.ok()) << config.status().to_string();
    const int power = config->precision.initial_scale_power;
    EXPECT_EQ(LossScaler(config->precision).scale(), std::ldexp(1.0, power)) << power;
  }
  EXPECT_FALSE(parse_config(R"({"fp16": {"initial_scale_power": 64}})", "test.json").ok());
  EXPECT_EQ(LossScaler(fp16_dynamic(16)).scale(), 65536.0);
  EXPECT_GT(LossScaler(fp16_dynamic(63)).scale(), 0.0);
}

}  // namespace
}  // namespace tz::detail
