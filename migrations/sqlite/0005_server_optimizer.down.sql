DROP TABLE optimizer_states;
