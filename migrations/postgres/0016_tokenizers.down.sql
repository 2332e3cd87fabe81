DROP TABLE tokenizers;
