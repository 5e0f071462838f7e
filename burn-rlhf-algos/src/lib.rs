//! verl's RL-for-LLM algorithms on Burn: advantage estimators, policy and value losses, KL
//! penalties and controllers, as pure tensor functions generic over `B: Backend`.

pub mod names;
